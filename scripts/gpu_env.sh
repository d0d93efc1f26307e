# Sourced by the device scripts (gpu_session.sh, gpu_profile_bwd.sh, gpu_ab.sh): strict mode, the
# repository root as working directory, $OUT (default ./gpu_out) created, unbuffered Python, and
# the system C++ compiler where the image has one.  The device image's default C++ compiler
# (/opt/gcc) links a private copy of libstdc++ into the extension, whose iostreams then crash on
# the process's (system) locale objects the first time a TORCH_CHECK message formats a number;
# the system g++ links libstdc++ dynamically.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++; fi
