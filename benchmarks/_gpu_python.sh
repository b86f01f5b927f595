# Sourced by the GPU scripts: run from the source tree, and pick the first Python that imports
# what the script needs (and sees a CUDA device, unless --dry-run).
#   gpu_python NAME "MODULES" "$@"   ->   sets $py, or exits 2 with one line saying what is missing
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # progress lines reach a remote log as they happen

gpu_python() {
    local name=$1 modules=$2 need_cuda=1 candidate
    shift 2
    for arg in "$@"; do [ "$arg" = "--dry-run" ] && need_cuda=0; done
    local probe="import $modules; import torch; assert $need_cuda == 0 or torch.cuda.is_available()"
    py=""
    for candidate in ${PYTHON:-} python3 .venv/bin/python python; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$probe" >/dev/null 2>&1; then
            py="$candidate"
            break
        fi
    done
    if [ -z "$py" ]; then
        echo "$name: no Python with $modules$([ $need_cuda = 1 ] && echo ' and a CUDA device') found" \
             "(tried \$PYTHON, python3, .venv/bin/python, python)" >&2
        exit 2
    fi
    echo "$name: using $py ($("$py" -c 'import sys; print(sys.executable)'))"
}
