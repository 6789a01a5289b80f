"""Custom ops and their implementations. Importing this package registers the ops.

This folder installs as `compiled_engine.kernels`. When the source tree's root is on `sys.path`
(`python -m ...` or pytest from the checkout), it is also importable as a bare top-level `kernels`,
which would shadow the PyPI distribution of that name: transformers (>= 5.25) depends on it and
imports it while transformers itself is importing. Under that name this file therefore loads the
installed distribution instead (stdlib only: `compiled_engine` cannot be imported from here, it
is the one importing transformers) and never registers anything.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _source_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _search = [p for p in sys.path if os.path.abspath(p or os.curdir) != _source_root]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _search)
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError(
            "No module named 'kernels' (compiled-engine's kernels/ folder installs as "
            "compiled_engine.kernels, not as a top-level package)",
            name=__name__,
        )
    _installed = importlib.util.module_from_spec(_spec)
    # The import statement returns whatever sys.modules holds under the name once this file has
    # run, so the installed module replaces this one for every importer.
    sys.modules[__name__] = _installed
    _spec.loader.exec_module(_installed)
else:
    from compiled_engine.kernels import collectives as _collectives  # noqa: F401
    from compiled_engine.kernels import cpu_attention as _cpu_attention  # noqa: F401
    from compiled_engine.kernels import inline_attention as _inline_attention  # noqa: F401
    from compiled_engine.kernels import paged_attention as _paged_attention  # noqa: F401
    from compiled_engine.kernels import prefill_attention as _prefill_attention  # noqa: F401
    from compiled_engine.kernels.paged_attention import PAGED_ATTENTION_VERSION

    # The Triton op is optional: triton ships for Linux x86_64 only, and the torch op runs everywhere.
    try:
        import triton  # noqa: F401
    except ImportError:
        TRITON_AVAILABLE = False
    else:
        TRITON_AVAILABLE = True

    if TRITON_AVAILABLE:
        # Registers torch.ops.compiled_engine.paged_attention_triton; needs no GPU to import.
        from compiled_engine.kernels import triton_attention as _triton_attention  # noqa: F401

    __all__ = ["PAGED_ATTENTION_VERSION", "TRITON_AVAILABLE"]
