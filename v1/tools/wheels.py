"""The wheels a bare CUDA machine needs to run the engine, brought along for an offline install.

Such a machine (see `make gpu-check`) has torch, triton, transformers and xxhash, but not the
engine's own messaging and structured-output packages, and no network. Here (with network):

    python3 -m v1.tools.wheels download --python-version 3.12 --dest .whl

fetches manylinux x86-64 wheels of every package below for that CPython into `.whl/` (git
ignores it); there (offline):

    python3 -m v1.tools.wheels install --wheels .whl --target /tmp/v1-gpu-site

installs those whose module is missing into `--target`, which then goes on PYTHONPATH. Wheels
for several Python versions can share the folder: pip picks the ones that fit the interpreter.

The pins are the versions the project's venv was tested with. msgspec (the engine's message
structs, `v1.request`, `v1.outputs`) and pyzmq (`v1.engine.core_client`) are imported by the
engine even in-process; xgrammar (imported by the engine core for structured output) needs
pydantic and apache-tvm-ffi; gguf is only read when a GGUF file is loaded.
"""

import argparse
import importlib.util
import subprocess
import sys

# import name -> distribution pin (no dependencies are resolved: every one is listed).
PACKAGES = {
    "msgspec": "msgspec==0.22.0",
    "zmq": "pyzmq==27.3.0",
    "gguf": "gguf==0.19.0",
    "xgrammar": "xgrammar==0.2.8",
    "tvm_ffi": "apache-tvm-ffi==0.1.15.post2",
    "pydantic": "pydantic==2.14.3",
    "pydantic_core": "pydantic-core==2.50.4",
    "annotated_types": "annotated-types==0.8.0",
    "typing_inspection": "typing-inspection==0.4.5",
}

# pip matches manylinux tags exactly: these cover the wheels of the pins above.
PLATFORMS = (
    "manylinux1_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64",
    "manylinux_2_24_x86_64", "manylinux_2_26_x86_64", "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
)


def missing_packages() -> list[str]:
    """Pins of the packages whose module this interpreter cannot import."""
    return [pin for module, pin in PACKAGES.items() if importlib.util.find_spec(module) is None]


def download(python_version: str, dest: str) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", python_version, "--implementation", "cp", *platforms,
         "-d", dest, *PACKAGES.values()],
        check=True,
    )


def install(wheels: str, target: str) -> list[str]:
    """Install the missing packages from `wheels` into `target`, offline; returns their pins."""
    missing = missing_packages()
    if missing:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--find-links", wheels, "--target", target, *missing],
            check=True,
        )
    return missing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m v1.tools.wheels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    down = sub.add_parser("download", help="fetch the wheels for a CPython version")
    down.add_argument("--python-version", default="3.12", help="e.g. 3.12 (the GPU machine's)")
    down.add_argument("--dest", default=".whl")
    inst = sub.add_parser("install", help="install the missing packages, offline")
    inst.add_argument("--wheels", default=".whl")
    inst.add_argument("--target", required=True, help="a folder to put on PYTHONPATH")
    args = parser.parse_args(argv)
    if args.action == "download":
        download(args.python_version, args.dest)
    else:
        installed = install(args.wheels, args.target)
        print(f"installed into {args.target}: {' '.join(installed) or 'nothing (none missing)'}")


if __name__ == "__main__":
    main()
