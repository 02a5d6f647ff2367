"""Build and load the C++ stubs of torch.ops.tritonblas.* (csrc_stubs/tritonblas_stubs.cpp).

The stubs are what a process without Python needs to run a model that calls these ops: the
schemas, shape functions and an aten fallback (see the .cpp). Build them for the torch you
deploy with (the library is tied to that torch's C++ ABI):

    python -m tritonblas_ops.stubs build          # prints the path of the shared library
    python -m tritonblas_ops.stubs path           # the path it has, or would have, once built
    python -m tritonblas_ops.stubs build-runner   # csrc_stubs/run_package.cpp, an example

In C++, load that file (dlopen, or link it with --no-as-needed) before loading the model, as
csrc_stubs/run_package.cpp does for an AOTInductor package.
In Python, `tritonblas_ops.stubs.load()` builds when needed and loads it; importing
tritonblas_ops before or after that is fine (schemas.py, and the .cpp, say why).

The library goes to $TRITONBLAS_OPS_STUBS_DIR, or to a folder per torch version under
~/.cache/tritonblas_ops (or $XDG_CACHE_HOME/tritonblas_ops); ninja rebuilds it when the
source changes.
"""

import argparse
import os
import pathlib
import shutil
import sys

import torch

NAME = "tritonblas_stubs"
SOURCES = pathlib.Path(__file__).resolve().parent.parent / "csrc_stubs"
DIR_ENV = "TRITONBLAS_OPS_STUBS_DIR"


def build_dir() -> pathlib.Path:
    if os.environ.get(DIR_ENV):
        return pathlib.Path(os.environ[DIR_ENV])
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return cache / "tritonblas_ops" / f"stubs-torch{torch.__version__}"


def library_path() -> pathlib.Path:
    """Where `load()` (and so `build`) puts the shared library."""
    return build_dir() / f"{NAME}.so"


def load(verbose: bool = False) -> pathlib.Path:
    """Build the stubs if they are missing or stale, load them into this process, return the
    library's path."""
    path = _build(
        NAME,
        build_dir(),
        # cpp_extension links libtorch_python; as-needed drops it (the stubs use no Python),
        # so that a process without Python can load the library.
        extra_ldflags=["-Wl,--as-needed"],
        is_python_module=False,
        verbose=verbose,
    )
    # Older torch versions load the library without returning its path.
    return pathlib.Path(path) if isinstance(path, str) else library_path()


def build_runner(verbose: bool = False) -> pathlib.Path:
    """Build csrc_stubs/run_package.cpp, a program without Python that loads the stubs and
    runs an AOTInductor package (an example of deployment, and a test of it); its path."""
    return pathlib.Path(_build("run_package", build_dir() / "runner", is_standalone=True,
                               is_python_module=False, verbose=verbose))


def _build(name: str, directory: pathlib.Path, **options):
    """cpp_extension.load of csrc_stubs/{name}.cpp, built in `directory` (one per target:
    cpp_extension writes its build.ninja there)."""
    source = SOURCES / f"{name}.cpp"
    if not source.exists():
        raise FileNotFoundError(
            f"{source} not found: the C++ stubs ship with the source tree, not in the wheel"
        )
    from torch.utils import cpp_extension

    _find_ninja()
    directory.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name=name, sources=[str(source)], build_directory=str(directory),
                              extra_cflags=["-O2"], **options)


def _find_ninja() -> None:
    """cpp_extension runs `ninja` from PATH; a venv's pip-installed ninja is not on it unless
    the venv is activated."""
    if shutil.which("ninja"):
        return
    candidates = [pathlib.Path(sys.executable).parent]
    try:
        import ninja  # the PyPI package

        candidates.insert(0, pathlib.Path(ninja.BIN_DIR))
    except ImportError:
        pass
    for folder in candidates:
        if (folder / "ninja").exists():
            os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
            return
    raise RuntimeError("building the C++ stubs needs ninja: pip install ninja")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tritonblas_ops.stubs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "path", "build-runner"])
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "build":
        print(load(verbose=args.verbose))
    elif args.command == "build-runner":
        print(build_runner(verbose=args.verbose))
    else:
        print(library_path())


if __name__ == "__main__":
    main()
