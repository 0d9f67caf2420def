"""What ``--fuse-contractions auto`` (the default) means: fuse only where a measurement showed it pays.

Fusing contractions into ``amplite::contract`` is a speed decision, not an accuracy one: it pays only where
the cuTENSOR backend runs and beats the permute+contiguous+bmm it replaces. ``auto`` therefore turns fusion
on only when all of these hold, and off otherwise:

* the conversion runs where CUDA is available;
* the cuTENSOR backend passes its probe there (``cutensor_backend.probe``, fp16 and bf16);
* ``MEASURED_FASTER`` lists this GPU: a ``bench/gpu_suite.py`` run on it showed the fused models faster
  than the unfused ones (the table in ``bench/RESULTS-gpu.md``).

No GPU run exists yet, so ``MEASURED_FASTER`` is empty and ``auto`` means off everywhere. ``on`` / ``off``
(or ``True`` / ``False`` from the Python API) force the choice.
"""

from __future__ import annotations

import torch

from amplite.errors import ConfigError

CHOICES = ("auto", "on", "off")

#: GPU names (``torch.cuda.get_device_name()`` substrings) on which bench/gpu_suite.py measured fusion with
#: cuTENSOR faster than without, each with where the measurement is recorded. Data, filled from a GPU run.
MEASURED_FASTER: dict[str, str] = {}


def resolve(choice: bool | str | None) -> tuple[bool, str]:
    """Whether to fuse for ``choice`` (``auto``/``on``/``off`` or a bool), and why, for the report.

    Raises:
        ConfigError: For a choice other than those .
    """
    if isinstance(choice, bool):
        return choice, "on (requested)" if choice else "off (requested)"
    value = "auto" if choice is None else str(choice).strip().lower()
    if value not in CHOICES:
        raise ConfigError(
            f"unknown fuse-contractions choice {choice!r}; expected one of {', '.join(CHOICES)}",
            "use --fuse-contractions auto, on or off",
        )
    if value != "auto":
        return value == "on", f"{value} (requested)"
    if not torch.cuda.is_available():
        return False, "auto: off (no CUDA device; fusion only pays with cuTENSOR on a GPU)"
    name = torch.cuda.get_device_name()
    from amplite.ops import cutensor_backend

    bad = [v.reason for dt in (torch.float16, torch.bfloat16) if not (v := cutensor_backend.probe("cuda", dt)).ok]
    if bad:
        return False, f"auto: off (cuTENSOR unusable on {name}: {bad[0]})"
    where = next((ref for key, ref in MEASURED_FASTER.items() if key in name), None)
    if where is None:
        return False, f"auto: off (no bench/gpu_suite.py measurement shows fusion faster on {name} yet)"
    return True, f"auto: on (measured faster on {name}: {where})"
