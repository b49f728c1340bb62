"""Measure the costs a schedule is built from, on the hardware it will run on (torch).

Per stage: F, B and W times with the runtime's own split backward, the activation memory each
pass leaves, and the time to pass the stage's outputs to the next rank. The result is a
``zbsearch.profile`` file in bytes, ready for ``zbsearch solve`` and the runtime.

=======================  ===============================================================
``load_model``           a user's ``package.module:function`` (``stages``)
``builtin_gpt``          the built-in GPT (``zbsearch.models``)
``builtin_moe``          the built-in GPT with experts (``zbsearch.models.moe``)
``Settings``             device, dtype, repetitions, threads (``settings``)
``profile_model``        one device, or one rank per pipeline rank under torchrun (``run``)
``profile_one_device``
``profile_distributed``
``measure_stage``        F, B, W of one stage (``measure``)
``in_step``              the same passes timed inside steps of the runtime (module)
``estimate_link``        latency and bandwidth between two local processes (``links``)
``profile_expert_parallel``  a MoE model on local expert-parallel processes, with its all-to-all (``experts``)
``profile_layers``       every unit of a model apart: a per-layer profile (``layers``)
``summary_table``        the profile as a rich table (``report``)
``runtime_vs_profile``   per-pass times of runtime traces against the profile (``accuracy``)
=======================  ===============================================================
"""

from .accuracy import PassAgreement, runtime_vs_profile
from .layers import profile_layers, unit_kinds, unit_names
from .links import LinkModel, estimate_link, pingpong
from .measure import StageMeasurement, Stats, measure_stage
from .report import layers_table, progress_bar, summary_table
from .run import profile_distributed, profile_model, profile_one_device
from .settings import Settings, resolve_device
from .stages import ModelSpec, as_model, builtin_gpt, builtin_moe, load_model, parse_model_args

__all__ = [
    "ModelSpec",
    "load_model",
    "parse_model_args",
    "as_model",
    "builtin_gpt",
    "builtin_moe",
    "Settings",
    "resolve_device",
    "profile_model",
    "profile_one_device",
    "profile_distributed",
    "measure_stage",
    "Stats",
    "StageMeasurement",
    "LinkModel",
    "estimate_link",
    "pingpong",
    "summary_table",
    "layers_table",
    "profile_layers",
    "unit_kinds",
    "unit_names",
    "progress_bar",
    "runtime_vs_profile",
    "PassAgreement",
]
