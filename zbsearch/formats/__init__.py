"""The file formats: every file zbsearch reads or writes, as a versioned pydantic model.

``profile`` (measured per-stage costs) -> ``schedule`` (per-rank action lists and what they
predict) -> ``trace`` (what the runtime measured); ``frontier`` (bubble against memory limit)
and ``torch_csv`` (a schedule in torch.distributed.pipelining's notation) are outputs.
``fileio`` reads them with one-line errors and writes them atomically.
"""
