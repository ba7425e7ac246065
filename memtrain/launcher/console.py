"""What the training console shows: memtrain's own lines, and libraries' output only when asked.

DeepSpeed prints while it starts and checkpoints: the shared-memory op's "built successfully", its bf16
optimizer's ``MA ... Max_MA ... CPU Virtual Memory`` lines (plain ``print``), its logger's info lines and
config dump. With ``logging.verbose: false`` (the default) :func:`library_output` captures Python-level
stdout/stderr around those calls and :func:`set_library_log_levels` keeps the libraries' loggers at
ERROR, so rank 0 prints memtrain's lines only; if a captured call fails, what it printed is replayed to
stderr before the error propagates (not before memtrain's own one-line errors). ``logging.verbose: true``
lets everything through and sets DeepSpeed's logger to INFO. Output written by C code or subprocesses
straight to the file descriptors (e.g. a first-time C++ op build) is not captured.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from typing import Iterator

from memtrain.errors import MemtrainError

# Loggers of libraries that speak during start-up and checkpoints (DeepSpeed's is "DeepSpeed").
LIBRARY_LOGGERS = ("DeepSpeed", "torch.utils.cpp_extension", "torch.distributed.elastic", "transformers",
                   "streaming")
# Deprecation warnings torch raises inside DeepSpeed's ZeRO collectives, one or two per step (24 lines in a
# 12-step ZeRO-3 run under torch 2.14): DeepSpeed's to act on, not the user's. Shown when verbose.
LIBRARY_WARNINGS = (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",)


def set_library_log_levels(verbose: bool) -> None:
    """INFO for DeepSpeed when ``verbose`` (its config dump and info lines; the others keep their own
    levels), ERROR for every library logger of :data:`LIBRARY_LOGGERS` and :data:`LIBRARY_WARNINGS` ignored
    otherwise."""
    for name in ("DeepSpeed",) if verbose else LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR)
    if not verbose:
        import warnings

        for message in LIBRARY_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    try:  # DeepSpeed's handler carries its own level too
        from deepspeed.utils import logger as ds_logger
    except ImportError:  # pragma: no cover - DeepSpeed is a dependency of the trainer
        return
    ds_logger.setLevel(logging.INFO if verbose else logging.ERROR)
    for handler in ds_logger.handlers:
        handler.setLevel(logging.INFO if verbose else logging.ERROR)


@contextlib.contextmanager
def library_output(verbose: bool) -> Iterator[None]:
    """Capture what libraries print inside the block (nothing is captured when ``verbose``)."""
    if verbose:
        yield
        return
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield
    except MemtrainError:  # diagnosed (a failed save, a damaged checkpoint): its one line says it all
        raise
    except BaseException:
        for text in (out.getvalue(), err.getvalue()):
            if text:
                sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()
        raise


__all__ = ["LIBRARY_LOGGERS", "library_output", "set_library_log_levels"]
