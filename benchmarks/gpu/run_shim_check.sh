#!/usr/bin/env bash
# libvgpu on a real GPU (lent H200 only; nothing in CI runs this). Under 5 minutes.
# Builds the shim and a driver-API check program, then prints:
#   1. memory limit enforcement and the cuMemGetInfo view under CUDA_DEVICE_MEMORY_LIMIT_0=4g
#   2. the NVML view (nvidia-smi under the shim)
#   3. SM-limit accuracy: kernel throughput at limits 25/50/75 relative to no limit
#   4. PyTorch under the shim, if torch is installed
# Usage: bash benchmarks/gpu/run_shim_check.sh   (from the repository root)
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
B=$(mktemp -d)
gcc -O2 -Wall -Wextra -Werror -fPIC -shared -fvisibility=hidden -Ilibvgpu/src -o "$B/libvgpu.so" libvgpu/src/*.c \
    -Wl,-Bsymbolic -ldl -lpthread || exit 1
gcc -O2 -Wall -Wextra -Werror -Ilibvgpu/src -o "$B/gpu_check" benchmarks/gpu/gpu_check.c -lcuda || exit 1
SHIM="$B/libvgpu.so"
run() { LD_PRELOAD="$SHIM" CUDA_DEVICE_MEMORY_SHARED_CACHE="$B/vgpu.cache" LIBVGPU_LOG_LEVEL=2 "$@"; }

echo "== 1. memory limit 4 GiB (cuMemGetInfo, cuMemAlloc)"
CUDA_DEVICE_MEMORY_LIMIT_0=4g run "$B/gpu_check" mem
echo "== 2. NVML view under the shim (limit 4 GiB)"
CUDA_DEVICE_MEMORY_LIMIT_0=4g run nvidia-smi --query-gpu=memory.total,memory.used,memory.free --format=csv || true
rm -f "$B/vgpu.cache"

echo "== 3. SM limit accuracy (kernel throughput relative to no limit)"
base=$("$B/gpu_check" sm 4 | sed -n 's/kernels_per_s=//p')
echo "no shim: ${base} kernels/s"
for L in 25 50 75; do
  rm -f "$B/vgpu.cache"
  k=$(CUDA_DEVICE_SM_LIMIT=$L run "$B/gpu_check" sm 6 | sed -n 's/kernels_per_s=//p')
  python3 -c "print(f'limit {$L}%: {float(\"$k\"):.1f} kernels/s = {100*float(\"$k\")/float(\"$base\"):.1f}% of unlimited')"
done

echo "== 4. PyTorch under the shim (limit 8 GiB), if installed"
if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  rm -f "$B/vgpu.cache"
  CUDA_DEVICE_MEMORY_LIMIT_0=8g run python3 - <<'PY'
import torch
free, total = torch.cuda.mem_get_info()
print(f"torch mem_get_info: free={free>>20} MiB total={total>>20} MiB")
x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
print("4 GiB tensor ok")
try:
    y = torch.empty(6 << 30, dtype=torch.uint8, device="cuda")
    print("UNEXPECTED: 6 GiB more succeeded")
except torch.cuda.OutOfMemoryError:
    print("6 GiB more -> OutOfMemoryError (expected)")
PY
else
  echo "torch with CUDA not available; skipped"
fi
rm -rf "$B"
