"""Run SGLang's own model files on srt, unmodified: an import remap.

    from srt.compat import sglang as sglang_compat

    sglang_compat.install()                                   # the remap
    classes = sglang_compat.register_model_file("llama.py")   # its EntryClass, registered
    # then srt.Engine(model_path=..., model_impl="sglang", model_file="llama.py") etc.

`install()` puts a finder first on `sys.meta_path` that answers the names SGLang's files import:

- `sglang.srt.X...` is `srt.X...`: the same module object under both names (each helper a model
  file imports lives in srt at SGLang's path: `srt.utils.add_prefix`, `srt.distributed.
  get_pp_indices`, `srt.layers.layer_boundary`, ...);
- `sglang.srt.models.utils` is `srt.models.utils` (so `create_fused_set_kv_buffer_arg` is srt's
  and builds `sgl_ext.FusedSetKVBufferArg`: the RoPE op then writes K and V); any other
  `sglang.srt.models.NAME` is the file NAME.py beside a registered model file (SGLang's files
  import each other: qwen3.py imports qwen2.py);
- `sglang.utils` is `srt.utils`, `sglang.kernels.X` is `sgl_ext.X`, `sgl_kernel` is `sgl_ext`;
- `sglang`, `sglang.srt`, `sglang.srt.models` and `sglang.kernels` are empty packages of the hook.

A name with no counterpart in srt raises ModuleNotFoundError naming both. Importing a file never
raises for a feature srt lacks: that happens when the model is built and asks for it.
`install()` refuses to run when the real `sglang` package is already imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
from types import ModuleType
from typing import Any

from torch import nn

from srt.models.registry import register_model_class

MODELS_PACKAGE = "sglang.srt.models"
# hook-owned empty packages
_PACKAGES = ("sglang", "sglang.srt", MODELS_PACKAGE, "sglang.kernels")
# SGLang name prefix -> srt name prefix (checked in order)
_PREFIXES = (("sglang.srt.", "srt."), ("sglang.kernels.", "sgl_ext."), ("sgl_kernel.", "sgl_ext."))
_EXACT = {"sglang.utils": "srt.utils", "sgl_kernel": "sgl_ext"}
# srt's own modules among `sglang.srt.models.*` (helpers, not model files)
_MODEL_HELPERS = {"utils": "srt.models.utils"}


def srt_name(sglang_name: str) -> str | None:
    """The srt module an SGLang module name maps to (None: a hook package or a model file)."""
    if sglang_name in _EXACT:
        return _EXACT[sglang_name]
    if sglang_name.startswith(MODELS_PACKAGE + "."):
        return _MODEL_HELPERS.get(sglang_name[len(MODELS_PACKAGE) + 1 :])
    for theirs, ours in _PREFIXES:
        if sglang_name.startswith(theirs):
            return ours + sglang_name[len(theirs) :]
    return None


def _ours(fullname: str) -> bool:
    return fullname.split(".", 1)[0] in ("sglang", "sgl_kernel")


class _PackageLoader(importlib.abc.Loader):
    """An empty package (its children come from the finder)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__doc__ = "A package of srt.compat.sglang's import remap (no code of SGLang's)."
        module.__srt_compat__ = True  # type: ignore[attr-defined]


class _AliasLoader(importlib.abc.Loader):
    """Answers an SGLang name with the srt module itself."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system gave the module the alias's spec; it keeps its own.
        module.__spec__ = self._spec


class SGLangFinder(importlib.abc.MetaPathFinder):
    """The meta-path finder of the remap (see the module docstring)."""

    def __init__(self) -> None:
        self.model_dirs: list[str] = []  # searched for `sglang.srt.models.NAME`, first first

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not _ours(fullname):
            return None
        if fullname in _PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, _PackageLoader(), is_package=True)
        ours = srt_name(fullname)
        if ours is None and fullname.startswith(MODELS_PACKAGE + "."):
            return self._model_file_spec(fullname)
        spec = None if ours is None else importlib.util.find_spec(ours)
        if ours is None or spec is None:
            raise ModuleNotFoundError(
                f"{fullname}: srt has no counterpart ({ours or 'unmapped name'}); this SGLang "
                "module is not provided by srt.compat.sglang",
                name=fullname,
            )
        is_pkg = spec.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(ours), is_package=is_pkg)

    def _model_file_spec(self, fullname: str) -> importlib.machinery.ModuleSpec:
        name = fullname[len(MODELS_PACKAGE) + 1 :]
        for d in self.model_dirs:
            file = os.path.join(d, name + ".py")
            if "." not in name and os.path.isfile(file):
                spec = importlib.util.spec_from_file_location(fullname, file)
                assert spec is not None
                return spec
        raise ModuleNotFoundError(
            f"{fullname}: no {name}.py beside the registered SGLang model files "
            f"(searched {self.model_dirs or 'no directories'}); put SGLang's {name}.py there",
            name=fullname,
        )


_LOCK = threading.Lock()
_FINDER: SGLangFinder | None = None


def installed() -> bool:
    return _FINDER is not None and _FINDER in sys.meta_path


def install() -> SGLangFinder:
    """Put the remap first on sys.meta_path (idempotent); returns the finder.

    Raises RuntimeError when the real `sglang` (or `sgl_kernel`) package is already imported:
    its modules would shadow the remap.
    """
    global _FINDER
    with _LOCK:
        if installed():
            assert _FINDER is not None
            return _FINDER
        for top in ("sglang", "sgl_kernel"):
            mod = sys.modules.get(top)
            if mod is not None and not isinstance(
                mod.__spec__ and mod.__spec__.loader, _PackageLoader | _AliasLoader
            ):
                raise RuntimeError(
                    f"the real {top!r} package is already imported; srt.compat.sglang.install() "
                    "must run before it (or in a process without it)"
                )
        _FINDER = _FINDER or SGLangFinder()
        sys.meta_path.insert(0, _FINDER)
        return _FINDER


def uninstall() -> None:
    """Remove the remap and forget the modules imported through it (srt's modules stay)."""
    global _FINDER
    with _LOCK:
        if _FINDER is not None and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
        _FINDER = None
        for name in [n for n in sys.modules if _ours(n)]:
            del sys.modules[name]


def import_model_file(path: str | os.PathLike[str]) -> ModuleType:
    """Import an SGLang model file through the remap (installing it) as
    `sglang.srt.models.<file stem>`; its directory joins the search path of sibling model files,
    first.

    Model files of the same names imported earlier from elsewhere (this one, or siblings it
    imports) are replaced by this directory's; classes already taken from them keep working.
    """
    file = os.path.abspath(os.fspath(path))
    if not os.path.isfile(file) or not file.endswith(".py"):
        raise FileNotFoundError(f"SGLang model file not found (a .py file): {path}")
    stem = os.path.basename(file)[:-3]
    if not stem.isidentifier():
        raise ValueError(f"model file name {stem!r} is not a Python module name")
    finder = install()
    with _LOCK:
        d = os.path.dirname(file)
        if d in finder.model_dirs:
            finder.model_dirs.remove(d)
        finder.model_dirs.insert(0, d)
        _forget_shadowed(d)
    return importlib.import_module(f"{MODELS_PACKAGE}.{stem}")


def _forget_shadowed(d: str) -> None:
    """Drop imported model files that a file of the same name in `d` now shadows (the
    registered file's folder comes first), so that they, and the siblings its file imports,
    load from `d`."""
    prefix = MODELS_PACKAGE + "."
    for name, mod in list(sys.modules.items()):
        if not name.startswith(prefix) or srt_name(name) is not None:
            continue
        file = os.path.abspath(getattr(mod, "__file__", "") or "")
        if os.path.dirname(file) != d and os.path.isfile(
            os.path.join(d, name[len(prefix) :] + ".py")
        ):
            del sys.modules[name]


def entry_classes(module: ModuleType) -> list[type[nn.Module]]:
    """The module's `EntryClass` (a class or a list of classes) as a list."""
    entry = getattr(module, "EntryClass", None)
    if entry is None:
        raise ValueError(f"model file {module.__file__} defines no EntryClass")
    classes = list(entry) if isinstance(entry, list | tuple) else [entry]
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(
                f"EntryClass of {module.__file__} holds {cls!r}, not an nn.Module class"
            )
    return classes


def register_model_file(path: str | os.PathLike[str]) -> list[type[nn.Module]]:
    """Import an SGLang model file (`import_model_file`) and register its EntryClass in
    `srt.models.registry` under model_impl "sglang", each class under its own name (the HF
    architecture it serves). Returns the classes."""
    classes = entry_classes(import_model_file(path))
    for cls in classes:
        register_model_class(cls, impl="sglang")
    return classes
