# Finding a python whose PyTorch the comparisons can run (sourced by
# bench/compare_torch.sh and bench/compare_torch_gpt.sh). Reads $PYTHON (a
# python the user named; tried first).

has_torch() { "$1" -c 'import torch, numpy' >/dev/null 2>&1; }
has_cuda_torch() { "$1" -c 'import sys, torch, numpy; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

# The first of $PYTHON, python3, /usr/bin/python3 that passes the check $1.
first_python_with() {
  local c
  for c in ${PYTHON:+"$PYTHON"} python3 /usr/bin/python3; do
    if command -v "$c" >/dev/null 2>&1 && "$1" "$c"; then command -v "$c"; return 0; fi
  done
  return 1
}
find_python() { first_python_with has_torch; }
find_cuda_python() { first_python_with has_cuda_torch; }

# Why no python can run --device cuda: what each one's torch says about CUDA.
cuda_python_refusal() {
  local c seen=""
  for c in ${PYTHON:+"$PYTHON"} python3 /usr/bin/python3; do
    command -v "$c" >/dev/null 2>&1 || continue
    seen+="; $c: $("$c" -c 'import torch
print("torch %s (CUDA build: %s), torch.cuda.is_available() = %s" % (torch.__version__, torch.version.cuda, torch.cuda.is_available()))' 2>/dev/null || echo "cannot import torch")"
  done
  echo "--device cuda: no python here has a PyTorch that sees a GPU${seen}. Run on a machine with an NVIDIA GPU and give --python PATH for a CUDA build of PyTorch (or use --device cpu)"
}
