"""Importing mosaicml-streaming without its dataset packages until they are used.

``import streaming`` runs ``streaming/__init__.py``, which imports the package's ready-made datasets
(``streaming.text``, ``streaming.vision``, ``streaming.multimodal``) before ``streaming.base``.
``streaming.text`` imports transformers' ``AutoTokenizer``, which pulls in ``transformers.generation``,
scikit-learn and SciPy: about 2.6 s of a training process's start on a 2-core machine, in every
rank, while memtrain reads its own shards with ``streaming.base`` alone.

:func:`defer_dataset_packages` puts a placeholder for each of the three packages in ``sys.modules``
before streaming is imported. ``streaming/__init__.py`` then binds the placeholders, and the first
use of a name from one of them (``streaming.text.StreamingC4``, ``from streaming.vision import
...``) imports the real package, which replaces its placeholder. The placeholder carries the real
package's ``__spec__``, ``__file__`` and ``__path__``, so tools that walk ``sys.modules`` (``inspect``,
torch's import-time checks) read them without importing it, and its submodules import as usual.
The standard library's ``importlib.util.LazyLoader`` is not used: on Python 3.11 reading
``__spec__`` or ``__file__`` loads the module, which happens in the middle of torch's own import.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types

DATASET_PACKAGES = ("streaming.multimodal", "streaming.text", "streaming.vision")


class _Deferred(types.ModuleType):
    """A dataset package of streaming not yet imported; any name but a probed dunder imports it."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__") and name != "__all__":
            raise AttributeError(name)
        return getattr(_load(self.__name__), name)


def _load(fullname: str) -> types.ModuleType:
    if isinstance(sys.modules.get(fullname), _Deferred):
        del sys.modules[fullname]
    module = importlib.import_module(fullname)
    setattr(sys.modules["streaming"], fullname.rpartition(".")[2], module)
    return module


def defer_dataset_packages() -> None:
    """Put placeholders for streaming's dataset packages in ``sys.modules`` (see the module doc).

    Does nothing when streaming is already imported or is not installed (a GPU machine with torch
    and triton alone), or when a package's files cannot be found.
    """
    if "streaming" in sys.modules:
        return
    try:
        spec = importlib.util.find_spec("streaming")
    except (ImportError, ValueError):
        return
    if spec is None or not spec.submodule_search_locations:
        return
    for fullname in DATASET_PACKAGES:
        sub = importlib.machinery.PathFinder.find_spec(fullname, list(spec.submodule_search_locations))
        if sub is None or sub.origin is None or fullname in sys.modules:
            continue
        placeholder = _Deferred(fullname, "streaming's dataset package, imported on first use")
        placeholder.__spec__ = sub
        placeholder.__loader__ = sub.loader
        placeholder.__file__ = sub.origin
        placeholder.__path__ = list(sub.submodule_search_locations or [])
        placeholder.__package__ = fullname
        sys.modules[fullname] = placeholder
