#!/usr/bin/env bash
# Installs the C++ build dependencies that are missing: Debian packages, and
# where nvcc exists the pinned CuTe/CUTLASS headers of the CUDA backend.
set -euo pipefail
need=()
for pkg in cmake ninja-build g++ ccache libgtest-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi

# The CUDA backend's CuTe/CUTLASS headers: the pinned nvidia-cutlass wheel, found by
# CMake through Python (only its headers are used, so --no-deps).
CUTLASS_PIN=4.2.0.0
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  if ! python3 -c "import importlib.metadata as m, sys; sys.exit(m.version('nvidia-cutlass') != '$CUTLASS_PIN')" 2>/dev/null; then
    echo "installing: nvidia-cutlass==$CUTLASS_PIN (CUDA headers)"
    python3 -m pip install -q --no-deps "nvidia-cutlass==$CUTLASS_PIN" ||
      echo "warning: nvidia-cutlass==$CUTLASS_PIN not installed: the default build leaves the CUDA backend off"
  fi
fi
