"""The Triton kernels, shipped as atom_moe.kernels (never as a top-level `kernels`).

A Python started in a checkout's root (`python -m ...`, `python -c ...`) has the root on sys.path, so
`import kernels` would find this folder and shadow the PyPI package of that name, which transformers
(>= 5.25) and SGLang import. Loaded under that name, this module hands the import over to the installed
`kernels` (or fails as a missing module would); loaded as atom_moe.kernels it does nothing.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError(f"No module named 'kernels' ({_checkout}/kernels is atom_moe.kernels, not a "
                                  f"top-level package)", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds once this file ran
    _spec.loader.exec_module(_module)
