"""How to measure: device, dtype, repetitions, threads; and the checks on them.

Kept apart so the one-device and torchrun paths read the same settings and record the same
``settings`` block in the profile file.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import asdict, dataclass

import torch

from ..distributed.timeouts import PEER_TIMEOUT_S
from ..errors import ZbError
from ..formats.profile import SELECTIVE_MODES

__all__ = ["Settings", "resolve_device", "resolve_dtype", "device_name", "cpu_cores"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Settings:
    """How the profiler measures; the same for every stage and rank, recorded in the profile.

    ``warmup`` untimed and ``repeat`` timed repetitions of each stage's passes, in ``rounds``
    over all stages and links. ``timeout``: seconds a rank waits for another rank's message
    while links are timed under torchrun (not recorded: it changes no measurement).
    """

    device: str = "cpu"  # "cpu", "cuda" or "cuda:<i>"; under torchrun "cuda" means cuda:LOCAL_RANK
    dtype: str | None = None  # None keeps the model's own dtype
    warmup: int = 3
    repeat: int = 10
    # Rounds over all stages and links, pooled (zbsearch.pooling): a machine's speed drifts
    # over seconds, and one round would catch each stage in one moment of it.
    rounds: int = 3
    threads: int | None = None  # CPU threads per process; None keeps torch's default
    # Keep freed host memory in the process (zbsearch.distributed.heap), as the runtime does by
    # default: otherwise passes are timed with page faults the runtime does not pay.
    keep_heap: bool = True
    # Also time each stage's forward checkpointed and its recompute pass, and measure what the
    # checkpointed forward keeps (t_fc, t_r, m_fc), and the same for selective recomputation
    # where the stage declares modules for it (t_fs, t_rs, m_fs): what solve --recompute needs.
    recompute: bool = False
    # Which modules selective recomputation re-runs (``formats.profile.SELECTIVE_MODES``): those
    # declared in this mode; None: no selective recomputation. Recorded as the profile's ``selective``.
    selective: str | None = "attention"
    # Under torchrun, also time the passes inside a few steps of the runtime, and take those
    # times (zbsearch.profiler.in_step): what a schedule's steps run, other microbatches in
    # flight and waits between passes included.
    in_step: bool = True
    timeout: float = PEER_TIMEOUT_S

    def check(self) -> None:
        """Raise a one-line ZbError for a setting no measurement can use."""
        if self.warmup < 1:
            raise ZbError("--warmup must be at least 1 (the first pass of a stage is always slow)")
        if self.repeat < 3:
            raise ZbError("--repeat must be at least 3 to give a median and a spread")
        if self.rounds < 1:
            raise ZbError("--rounds must be at least 1")
        if self.threads is not None and self.threads < 1:
            raise ZbError("--threads must be at least 1")
        if self.selective is not None and self.selective not in SELECTIVE_MODES:
            raise ZbError(f"--selective {self.selective!r}: choose {', '.join(SELECTIVE_MODES)} or none")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ZbError(f"--timeout must be a positive number of seconds, not {self.timeout:g}")
        resolve_dtype(self.dtype)

    def record(self) -> dict:
        """The settings block of the profile: these settings with the threads actually used."""
        out = {**asdict(self), "threads": torch.get_num_threads()}
        del out["timeout"]
        return out


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """The torch device for a name, failing in one line when CUDA is asked for and absent.

    A CUDA device is also made the process's current one: the passes measured on it run their
    backward on autograd's threads, which otherwise find no current context (cuBLAS warns and
    sets one up inside the first timed backward)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ZbError(f"unknown device {name!r}; use cpu, cuda or cuda:<index>") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ZbError(f"device {name!r} is not supported; use cpu or cuda")
    if not torch.cuda.is_available():
        raise ZbError(f"CUDA was requested but is not available (torch {torch.__version__} sees no GPU)")
    if device.index is not None:
        index = device.index
    else:  # torchrun's LOCAL_RANK, else the device a launcher made current
        index = local_rank if local_rank is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ZbError(f"device cuda:{index} requested but only {torch.cuda.device_count()} GPU(s) are visible")
    torch.cuda.set_device(index)
    # autograd's device thread still finds no current context at its first cuBLAS call; torch
    # then makes the primary context current itself, so its warning says nothing to the user
    warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context")
    return torch.device("cuda", index)


def resolve_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype for a name (float32, bfloat16, float16); None keeps the model's own."""
    if name is None:
        return None
    if name not in _DTYPES:
        raise ZbError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def device_name(device: torch.device) -> str:
    """What the profile records as its device: the GPU's name, or the CPU model and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"cpu: {model or os.uname().machine}, {os.cpu_count()} cores"
