#!/usr/bin/env bash
# One command for a lent GPU machine (the device tool runs it from the repository root; pip cannot
# reach the network there, so the checkout goes on PYTHONPATH and missing wheels travel in .whl/):
#
#   LEASE_S=540 bash benchmarks/gpu/device_session.sh lease   # the one call a 15-minute lease holds
#                                                 # (device tool: timeout_s 598, carry .whl): suite, bench, the
#                                                 # rfcs/0005 "Next" experiments, profile
#   bash benchmarks/gpu/device_session.sh suite   # pytest -m gpu (kernels against numpy, models on the GPU)
#   bash benchmarks/gpu/device_session.sh bench   # benchmarks/gpu/run_all.py (GEMM vs cuBLAS, models vs torch)
#   bash benchmarks/gpu/device_session.sh all     # suite + bench (float16) + GPT-2 kernel profile, < 10 min
#   bash benchmarks/gpu/device_session.sh newtiles  # ping-pong/stream-K GPU tests, then GPT-2 8x128 with them
#   bash benchmarks/gpu/device_session.sh sweep [TILE...]   # tiles x float16 GEMM shapes, then the tile refit
#   bash benchmarks/gpu/device_session.sh cpu     # the cpu kernel tests on this machine's host CPU (another
#                                                 # AVX-512 CPU than the Zen 4 dev VM's; CI's may have none)
#   bash benchmarks/gpu/device_session.sh pdl     # GPT-2 small 1x128/8x128 with programmatic dependent launch,
#                                                 # then the GEMMs at M 128/1024 plain and with it vs cuBLAS
#   bash benchmarks/gpu/device_session.sh kmajor  # GEMMs with B stored [N, K]: default tiles, then tma64x96/128x160
#   bash benchmarks/gpu/device_session.sh tuned   # the GEMM shapes with search_space=2 (tiles timed by the tuner)
#                                                 # vs cuBLAS, a call of its own (< 9 min)
#   bash benchmarks/gpu/device_session.sh ncu [GEMM.PY ARGS...]   # Nsight Compute sections of ours and
#                                                 # cuBLAS's kernel per case (default: GPT-2 shapes, M 1024, fp16)
#   bash benchmarks/gpu/device_session.sh bf16models  # GPT-2 small and Llama exported in bfloat16 vs torch.compile
#                                                 # on the same bfloat16 modules (1x128, 8x128), < 7 min
#   bash benchmarks/gpu/device_session.sh f16models  # the same exported in float16 (half activations on both
#                                                 # sides: like for like with torch's float16 run), < 7 min
#   bash benchmarks/gpu/device_session.sh decode  # products of 1-8 rows (the gemv template) vs cuBLAS, dense float16
#                                                 # on both weight layouts and 4-bit codes, < 5 min
#   bash benchmarks/gpu/device_session.sh cluster  # the cluster tiles (rfcs/0005 decisions 31, 32: split-K, B
#                                                 # multicast): their GPU tests, GPT-2's GEMMs on them vs cuBLAS,
#                                                 # GPT-2 8x128 with them, < 5 min
#   bash benchmarks/gpu/device_session.sh tf32    # precision="tf32" on the wgmma template: its GPU tests, then
#                                                 # every GEMM shape in TF32 vs cuBLAS's TF32, 3xTF32 vs SGEMM,
#                                                 # GPT-2 at tf32, < 9 min
#   bash benchmarks/gpu/device_session.sh attention  # the fused attention on float32 operands (TF32, 3xTF32) and
#                                                 # split-KV: GPU tests, then every type's kernel vs torch's SDPA, < 4 min
#   bash benchmarks/gpu/device_session.sh conv    # Stable Diffusion 1.5's UNet convs at batch 2, grouped and
#                                                 # transposed convs vs torch's (cuDNN), float16 and bfloat16, < 4 min
#   bash benchmarks/gpu/device_session.sh cnn     # ResNet-50 end to end (batch 1, 8; float16) vs torch eager and
#                                                 # torch.compile, channels-last, < 9 min
#   bash benchmarks/gpu/device_session.sh regnet  # RegNetY-4GF likewise (grouped convs), exported in float16, < 5 min
#   bash benchmarks/gpu/device_session.sh llama7b # Llama-2-7B's shapes (synthetic weights) on one GPU vs torch
#                                                 # eager and torch.compile at 1x128 and 8x128, float16, < 9 min
#   bash benchmarks/gpu/device_session.sh steps   # decoding steps end to end (decode.py: a 0.6B grouped-heads
#                                                 # Llama, KV cache kept on the device) vs torch eager and
#                                                 # torch.compile, batches 1 and 8, < 8 min
#   bash benchmarks/gpu/device_session.sh run CMD ARGS...   # any command with the same setup
#
# tests/codegen/test_device_session.py runs every mode on a machine without a GPU, with stand-ins for python3,
# nvidia-smi and ncu: each benchmark command must parse and (-m slow) each pytest selection collect tests.
# Results go to $OUT (the device tool brings that folder back): gpu-suite.txt, and
# <device>-<date>-gpu.json/.txt (the lease: also lease-more.tar.gz, its other files; pack_lease); copy them
# into benchmarks/results/ and commit them.
# Wheels to carry (here: `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl pulp==3.3.2 mpi4py mpich highspy`,
# with `/.whl/` in .git/info/exclude), named in the tool's `carry`.
set -uo pipefail
what=${1:-suite}
out=${OUT:-/tmp/out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
fi
mkdir -p /tmp/pkg/shardflow
ln -sfn "$PWD/compiler" /tmp/pkg/shardflow/compiler
ln -sfn "$PWD/runtime" /tmp/pkg/shardflow/runtime
export PYTHONPATH=/tmp/pkg:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export SHARDFLOW_CACHE_DIR=${SHARDFLOW_CACHE_DIR:-/tmp/sf-cache}
# mpi4py finds its MPI library by dlopen, and `pip install --target` leaves the MPICH wheel's
# lib/ out: without this mpi4py takes the image's Open MPI while the carried MPICH mpiexec
# launches the ranks (each rank then sees a world of one)
if compgen -G ".whl/mpich-*.whl" > /dev/null; then
    mkdir -p /tmp/site/mpilib
    python3 - <<'PY' || exit 1
import glob, os, zipfile
with zipfile.ZipFile(glob.glob(".whl/mpich-*.whl")[0]) as z:
    for n in z.namelist():
        if "/data/lib/" in n and not n.endswith("/"):
            with open(os.path.join("/tmp/site/mpilib", os.path.basename(n)), "wb") as f:
                f.write(z.read(n))
PY
    export MPI4PY_LIBMPI=/tmp/site/mpilib/libmpi.so.12 LD_LIBRARY_PATH=/tmp/site/mpilib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# the GPU tests; the ping-pong and stream-K tiles' ones (-k "$new_tiles") run apart, under their own
# time limit, until the tiles have run on a GPU (a wrong hand-over between warpgroups, or a flag
# between blocks, would hang, or trap after half a minute, rather than fail)
gpu_tests=(tests/codegen/test_cuda_kernels.py tests/codegen/test_wgmma.py tests/codegen/test_attention.py
           tests/codegen/test_tune.py tests/runtime/test_gpu_runtime.py tests/codegen/test_channels_last.py)
new_tiles="pingpong or stream_k"
# the cluster tiles' GPU tests (not run on a GPU yet: a wrong exchange would wait forever)
cluster_tests="cluster_split_k or multicast"
# the float32 operands' wgmma GPU tests (rfcs/0005 decisions 33, 34; not run on a GPU yet): apart, in
# `tf32`, under its own time limit (the 3xTF32 split adds a barrier a K step)
float32_tests="tf32"
# pdl_models LIMIT_S: GPT-2 small at 1x128 and 8x128 compiled with optimization_config["pdl"] against
# torch.compile, appended to $out/models-tiles.txt under "== pdl"
pdl_models() {
    echo "== pdl" >> "$out/models-tiles.txt"
    timeout "$1" python3 benchmarks/gpu/models.py --models gpt2_small --batches 1,8 --precision float16 \
        --compile-modes reduce-overhead --export-dir /tmp/sf-export --pdl >> "$out/models-tiles.txt" 2>&1
    tail -6 "$out/models-tiles.txt"
}
# pdl_gemms LIMIT_S: every GEMM shape at M 128 and 1024 (float16), ours launched plainly, then built
# and launched for programmatic dependent launch with B a weight (its first stages load while the
# launch before finishes; rfcs/0005 decision 48), each against cuBLAS in the same run: $out/gemm-pdl.txt
pdl_gemms() {
    for flag in "" --pdl; do
        echo "== gemm ${flag:-plain}" >> "$out/gemm-pdl.txt"
        timeout $(($1 / 2)) python3 benchmarks/gpu/gemm.py --m 128,1024 --dtypes float16 --jobs 14 $flag \
            >> "$out/gemm-pdl.txt" 2>&1
    done
    grep -E "^== |gemm_vs_cublas_min" "$out/gemm-pdl.txt"
}
# sweep_tiles BUDGET_S TILE...: every float16 benchmark shape on each tile, one `== TILE` section
# each in $out/gemm-sweep.txt (the format fit_tiles.py reads; appended to, so that calls add up),
# no tile started after BUDGET_S seconds; then the refit with every section so far ($out/fit.txt)
sweep_tiles() {
    local budget=$1 start=$SECONDS sweep="$out/gemm-sweep.txt"
    shift
    [ -f "$sweep" ] || echo "# benchmarks/gpu/gemm.py --dtypes float16 --config C --jobs 14 for each tile C," \
        "$(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null)" > "$sweep"
    for c in "$@"; do  # TILE, or TILE@KT: with --split-min-kt KT (a section the refit leaves out)
        if (( SECONDS - start > budget )); then echo "(time is up: $c and later not run)" | tee -a "$sweep"; break; fi
        local tile=${c%@*} kt=() head="== ${c%@*}"
        [[ $c == *@* ]] && kt=(--split-min-kt "${c#*@}") && head="$head split-min-kt ${c#*@}"
        echo "$head" >> "$sweep"
        timeout 90 python3 benchmarks/gpu/gemm.py --dtypes float16 --config "$tile" "${kt[@]}" --jobs 14 2>&1 \
            | grep -E " ours |WRONG|Error|error" >> "$sweep"
        echo "$c: $(grep -c " ours " "$sweep") case lines so far ($((SECONDS - start)) s)"
    done
    python3 benchmarks/gpu/fit_tiles.py --sweep benchmarks/results/h100-2026-11-22-wgmma-tiles.txt \
        benchmarks/results/h100-2026-11-22-tma-tiles.txt "$sweep" \
        --spread-sweep benchmarks/results/h100-2026-11-23-tma-spread-split-tiles.txt 2>&1 | tee "$out/fit.txt" | tail -40
}
# ncu_gemm LIMIT_S FILE GEMM.PY ARGS...: one launch of ours and one of cuBLAS per case (gemm.py --ncu) under
# Nsight Compute (its speed of light, launch, occupancy, memory and warp-state sections; clocks left to
# the GPU, as the timings run), written to $out/FILE
ncu_gemm() {
    local limit=$1 file=$2 ncu
    shift 2
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$ncu" ] || { echo "no ncu on this machine" | tee "$out/$file"; return; }
    timeout "$limit" "$ncu" --profile-from-start off --clock-control none --section SpeedOfLight \
        --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 benchmarks/gpu/gemm.py --reps 3 --jobs 14 --ncu "$@" > "$out/$file" 2>&1
    grep -E "^  [a-z_0-9]+_M[0-9]+_|Duration|Compute \(SM\) Throughput|Memory Throughput|==PROF==|rror" \
        "$out/$file" | head -60
}
# cluster_tiles LIMIT_S: the cluster tiles (RFC 0005 decisions 31 and 32, never run on a GPU before):
# their GPU tests under a time limit (a wrong exchange would hang), then GPT-2's and Llama-7B's float16
# products at M = 128 and 1024 on the default tiles and on each of them against cuBLAS in the same run
# ($out/gemm-cluster.txt; by decision 31's account ck gains most on GPT-2 at M = 1024 and Llama at 128),
# then GPT-2 small 8x128 against torch.compile (models-tiles.txt) with its two N = 768 products
# (attn_out, fc2: 96 tiles of 64 x 128 by default, 96 blocks of half the K tiles here) on ck128x128,
# then with B multicast on all four projections
ck_model_tiles='{"*/attn/c_proj/Gemm": "ck128x128", "*/mlp/c_proj/Gemm": "ck128x128"}'
mc_model_tiles='{"*/attn/c_proj/Gemm": "mc64x128", "*/mlp/c_proj/Gemm": "mc64x128", "*/attn/c_attn/Gemm": "mc128x192",
                 "*/mlp/c_fc/Gemm": "mc128x192"}'
cluster_tiles() {
    local start=$SECONDS f="$out/gemm-cluster.txt" par=()
    python3 -c "import xdist" 2>/dev/null && par=(-n 6)  # (their time is mostly nvcc: about 60 builds)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider "${par[@]}" -k "$cluster_tests" "${gpu_tests[@]}" 2>&1 \
        | tee "$out/gpu-suite-ck.txt" | tail -8
    if ! grep -qE "[0-9]+ passed" "$out/gpu-suite-ck.txt" || grep -qE "[0-9]+ (failed|error)" "$out/gpu-suite-ck.txt"; then
        echo "(cluster split-K tests did not pass: no timing)"; return
    fi
    echo "# benchmarks/gpu/gemm.py --m 128,1024 --shapes gpt2,llama7b --dtypes float16 --config C, $(date -u +%F)," \
        "commit $(git rev-parse --short HEAD 2>/dev/null)" > "$f"
    for c in default ck128x128 ck64x128 mc64x128 mc128x192 ck4_64x128 ck128x256 mc128x256 ck4_128x128 mc128x128; do
        (( SECONDS - start > $1 - 60 )) && break
        echo "== $c" >> "$f"
        local cfg=(); [ "$c" = default ] || cfg=(--config "$c")
        timeout 45 python3 benchmarks/gpu/gemm.py --m 128,1024 --shapes gpt2,llama7b --dtypes float16 --jobs 14 \
            "${cfg[@]}" 2>&1 | grep -E " ours |WRONG|rror" >> "$f"
    done
    grep -E "^==|gpt2_.*_M1024_|llama7b_.*_M128_" "$f"
    for tiles in "$ck_model_tiles" "$mc_model_tiles"; do
        (( SECONDS - start < $1 - 50 )) || break
        echo "== gemm_tiles $tiles" >> "$out/models-tiles.txt"
        timeout $(( $1 - (SECONDS - start) )) python3 benchmarks/gpu/models.py --models gpt2_small --batches 8 \
            --precision float16 --compile-modes reduce-overhead --export-dir /tmp/sf-export \
            --gemm-tiles "$tiles" >> "$out/models-tiles.txt" 2>&1
        tail -4 "$out/models-tiles.txt"
    done
}
# kmajor: GEMMs with B stored [N, K] (gemm.py --b-layout nk) on the default tiles, then on the tiles for
# a K-major B (tma64x96 on N = 768, tma128x160 on N = 2304), into $out/gemm-kmajor.txt
# the GPT-2 projections on the tiles for a K-major B (their weights then stored [N, K]: driver.py)
kmajor_tiles='{"*/attn/c_proj/Gemm": "tma64x96", "*/mlp/c_proj/Gemm": "tma64x96", "*/attn/c_attn/Gemm": "tma128x160"}'
kmajor() {
    local f="$out/gemm-kmajor.txt" common=(--b-layout nk --dtypes float16,bfloat16 --jobs 14)
    echo "# benchmarks/gpu/gemm.py --b-layout nk, $(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null)" \
        > "$f"
    echo "== default tiles" >> "$f"
    timeout 60 python3 benchmarks/gpu/gemm.py "${common[@]}" --m 128,1024,8192 --shapes gpt2 >> "$f" 2>&1
    echo "== tma64x96" >> "$f"
    timeout 45 python3 benchmarks/gpu/gemm.py "${common[@]}" --m 1024,8192 --shapes gpt2.attn_out,gpt2.fc2 \
        --config tma64x96 >> "$f" 2>&1
    echo "== tma128x160" >> "$f"
    timeout 45 python3 benchmarks/gpu/gemm.py "${common[@]}" --m 1024,8192 --shapes gpt2.qkv --config tma128x160 \
        >> "$f" 2>&1
    grep -E "^==| ours |WRONG|rror" "$f"
}
# pack_lease: the device tool brings back at most 8 files from $OUT, and the lease writes a dozen; it
# writes them into a stage ($out), and after each step this copies the headline files (the suite's
# log, the benchmark's log and its results JSON and TXT) to $OUT ($lease_out) and archives the
# others there as lease-more.tar.gz (`tar -xzf` it), so that what comes back is whole up to the
# last step finished, also when the call is cut off
pack_lease() {
    local f b rest=()
    for f in "$out"/*; do
        [ -f "$f" ] || continue
        b=${f##*/}
        case "$b" in
            gpu-suite.txt|bench.txt|*-gpu.json|*-gpu.txt) cp -p "$f" "$lease_out/$b" ;;
            *) rest+=("$b") ;;
        esac
    done
    if (( ${#rest[@]} )); then
        tar -czf "$lease_out/lease-more.tar.gz.part" -C "$out" "${rest[@]}" \
            && mv "$lease_out/lease-more.tar.gz.part" "$lease_out/lease-more.tar.gz"
    fi
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m shardflow.runtime.native || exit 1   # the runtime's native library, built in place
case "$what" in
    suite)
        python3 -m pytest -q -m gpu -p no:cacheprovider -k "not ($new_tiles or $cluster_tests or $float32_tests)" "${gpu_tests[@]}" 2>&1 \
            | tee "$out/gpu-suite.txt" | tail -60
        timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -k "$new_tiles" tests/codegen/test_wgmma.py 2>&1 \
            | tee "$out/gpu-suite-pp-sk.txt" | tail -15
        ;;
    bench)
        python3 benchmarks/gpu/run_all.py --out-dir "$out" --budget-s "${BUDGET_S:-540}" --jobs 12 2>&1 | tail -150
        ;;
    all)  # the suite, then the benchmark (float16 models), then a kernel profile of GPT-2 small 8x128;
          # the timeouts (210 + 265 + 75 s) add up to under the device tool's 600 s per call
          # (measured in session 5: 205 + 170 + 60 s); the ping-pong and stream-K tiles' tests are
          # left to `newtiles` (not yet run on a GPU: a hang there must not take the rest down)
        timeout 210 python3 -m pytest -q -m gpu -p no:cacheprovider -k "not ($new_tiles or $cluster_tests or $float32_tests)" "${gpu_tests[@]}" 2>&1 \
            | tee "$out/gpu-suite.txt" | tail -15
        mkdir -p /tmp/sf-export
        timeout 265 python3 benchmarks/gpu/run_all.py --out-dir "$out" --budget-s "${BUDGET_S:-250}" --jobs 14 \
            --precision float16 --export-dir /tmp/sf-export > "$out/bench.txt" 2>&1
        tail -30 "$out/bench.txt"
        timeout 75 python3 benchmarks/gpu/kernel_profile.py --model gpt2_small --batch 8 --work /tmp/sf-export \
            --top 40 --json "$out/profile.json" > "$out/profile.txt" 2>&1
        tail -12 "$out/profile.txt"
        ;;
    lease)  # a lent task has 15 minutes of device time, the machine's start (1-2 min) and idle time
            # included: one call (timeout_s 598, LEASE_S=540) with everything in order of what issue 5's
            # acceptance needs, each step under its own limit and none started past the deadline
            # (LEASE_S, default 480 s): the GPU suite (session 33: 64 s with xdist), the benchmark's
            # results file (float16 GEMMs vs cuBLAS, GPT-2 and Llama vs torch.compile; it skips what no
            # longer fits and rewrites its JSON after each step; session 33: 178 s), then the
            # experiments of rfcs/0005 "Next" while time is left: GEMMs with B stored [N, K] (the
            # 96/160-column tiles), GPT-2 8x128 on those tiles and with a ping-pong lm_head, Nsight
            # Compute on GPT-2's M = 1024 products, the GPT-2 8x128 kernel profile (the device tool
            # brings back 8 files: the experiments' come back in lease-more.tar.gz, pack_lease)
        deadline=$((SECONDS + ${LEASE_S:-480}))
        lease_out=$out out=${SF_LEASE_STAGE:-/tmp/sf-lease-out}  # (the stage: pack_lease)
        rm -rf "$out" && mkdir -p "$out"
        # the suite's time is mostly nvcc (session 5: 368 tests in 189 s): spread over the host's cores
        # where pytest-xdist is there (the image has it; the kernel cache writes by rename)
        xdist=()
        python3 -c "import xdist" 2>/dev/null && xdist=(-n 6)
        # (the ping-pong and stream-K tiles' tests with the others: they passed on the H200 in session 33)
        timeout 210 python3 -m pytest -q -m gpu -p no:cacheprovider "${xdist[@]}" -k "not ($cluster_tests or $float32_tests)" "${gpu_tests[@]}" 2>&1 \
            | tee "$out/gpu-suite.txt" | tail -15
        echo "suite done at ${SECONDS} s"
        pack_lease
        budget=$((deadline - SECONDS - 75))
        mkdir -p /tmp/sf-export
        if (( budget > 60 )); then
            timeout $((budget + 15)) python3 benchmarks/gpu/run_all.py --out-dir "$out" --budget-s "$budget" --jobs 14 \
                --precision float16 --export-dir /tmp/sf-export > "$out/bench.txt" 2>&1
            tail -30 "$out/bench.txt"
        else
            echo "(no time left for the benchmark: ${budget} s)"
        fi
        pack_lease
        # the cluster tiles (RFC 0005 decisions 31, 32, not run before): tests, GEMMs, GPT-2 8x128
        if (( deadline - SECONDS > 280 )); then
            cluster_tiles 200
            pack_lease
        fi
        # programmatic dependent launch (RFC 0005 decision 29, not timed before): GPT-2 small at 1x128
        # and 8x128 with each kernel launched while the one before it finishes, against torch.compile
        # in the same run (run_all's figures are the same program without it); a section of
        # models-tiles.txt
        if (( deadline - SECONDS > 250 )); then
            pdl_models 130
            pack_lease
        fi
        # the GEMMs with it (decision 48: a weight's first stages before the wait), plain beside them
        if (( deadline - SECONDS > 220 )); then
            pdl_gemms 120
            pack_lease
        fi
        # B stored [N, K]: the default tiles, then the 96- and 160-column tiles that fill the
        # multiprocessors on GPT-2's shapes (RFC 0005 decision 27), against cuBLAS on the same layout
        if (( deadline - SECONDS > 200 )); then
            kmajor
            pack_lease
        fi
        # GPT-2 small 8x128 end to end against torch.compile: with its weights stored [N, K] on those
        # tiles; then with the lm_head (0.2 of 1.0 ms, short K, 1576 tiles) on the ping-pong tile, whose
        # epilogue overlaps the other warpgroup's products (session 33's sweep: +10% on such shapes)
        for tiles in "$kmajor_tiles" '{"*/lm_head/MatMul": "pp64x256"}'; do
            if (( deadline - SECONDS > 170 )); then
                echo "== gemm_tiles $tiles" >> "$out/models-tiles.txt"
                timeout 100 python3 benchmarks/gpu/models.py --models gpt2_small --batches 8 --precision float16 \
                    --compile-modes reduce-overhead --export-dir /tmp/sf-export --gemm-tiles "$tiles" \
                    >> "$out/models-tiles.txt" 2>&1
                tail -4 "$out/models-tiles.txt"
                pack_lease
            fi
        done
        # what the GPT-2 products at M = 1024 (0.71-0.82 of cuBLAS, none reaches 0.9 on any tile) spend
        # their time on, next to cuBLAS's kernels (rfcs/0005 "Next")
        if (( deadline - SECONDS > 150 )); then
            ncu_gemm 90 ncu-gemm.txt --m 1024 --shapes gpt2 --dtypes float16
            pack_lease
        fi
        if (( deadline - SECONDS > 60 )); then
            timeout $((deadline - SECONDS)) python3 benchmarks/gpu/kernel_profile.py --model gpt2_small --batch 8 \
                --work /tmp/sf-export --top 40 --json "$out/profile.json" > "$out/profile.txt" 2>&1
            tail -12 "$out/profile.txt"
            pack_lease
        fi
        echo "lease done at ${SECONDS} s"
        ;;
    newtiles)  # the tiles no GPU has run yet: their GPU tests (under a time limit), then GPT-2 small
               # at 8x128 with them on the products they are meant for (stream-K on the three whose
               # 96 tiles leave 36 of 132 multiprocessors idle, ping-pong on the lm_head): the kernel
               # profile (compare with `all`'s) and the end-to-end figure against torch.compile
        timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -k "$new_tiles" tests/codegen/test_wgmma.py 2>&1 \
            | tee "$out/gpu-suite-pp-sk.txt" | tail -15
        tiles='{"*/attn/c_attn/Gemm": "sk128x192", "*/attn/c_proj/Gemm": "sk64x128", "*/mlp/c_proj/Gemm": "sk64x128",
                "*/lm_head/MatMul": "pp64x256"}'
        mkdir -p /tmp/sf-export
        timeout 100 python3 benchmarks/gpu/kernel_profile.py --model gpt2_small --batch 8 --work /tmp/sf-export \
            --gemm-tiles "$tiles" --top 40 --json "$out/profile-newtiles.json" > "$out/profile-newtiles.txt" 2>&1
        tail -12 "$out/profile-newtiles.txt"
        timeout 190 python3 benchmarks/gpu/models.py --models gpt2_small --batches 8 --precision float16 \
            --compile-modes reduce-overhead --export-dir /tmp/sf-export --gemm-tiles "$tiles" \
            --json "$out/models-newtiles.json" > "$out/models-newtiles.txt" 2>&1
        tail -20 "$out/models-newtiles.txt"
        ;;
    sweep)  # every float16 benchmark shape on each tile (default: the shipped TMA tiles, for a same-day
            # reference, then the unmeasured stream-K and ping-pong ones, and sk64x128 with blocks of
            # 4 K tiles on average instead of 8), then the refit with them in
        shift
        tiles=("$@")
        [ ${#tiles[@]} -eq 0 ] && tiles=(tma128x256 tma128x192 tma128x128 tma64x128 sk64x128 sk128x192 sk128x256
                                         sk128x128 pp64x256 pp64x192 pp64x128 sk64x128@4 ck128x128 ck64x128
                                         ck128x256 ck4_128x128 ck4_64x128 mc128x256 mc128x192 mc128x128 mc64x128)
        sweep_tiles "${SWEEP_S:-480}" "${tiles[@]}"
        ;;
    cpu)  # the cpu kernels against numpy on this host, with the ISA it has (the AVX-512 GEMM reads two
          # 16-column prepacked panels per tile: compiled everywhere, run only where a CPU has AVX-512)
        grep -o -m1 'avx512f' /proc/cpuinfo || echo "no avx512f on this host"
        timeout 400 python3 -m pytest -q -p no:cacheprovider tests/codegen/test_cpu_kernels.py \
            tests/driver/test_prepack.py 2>&1 | tee "$out/cpu-kernels.txt" | tail -15
        ;;
    cluster)  # the cluster tiles: GPU tests, GEMMs vs cuBLAS, GPT-2 8x128 (under 5 minutes)
        mkdir -p /tmp/sf-export
        cluster_tiles 280
        ;;
    kmajor)  # B stored [N, K]: default tiles, then the 96- and 160-column ones (a minute or two)
        kmajor
        ;;
    tuned)  # the 48 GEMM shapes built with search_space=2 (the tuner times 15 tiles of each on this GPU, the
            # ping-pong and stream-K ones among them since session 77) against cuBLAS: what a user who
            # tunes gets, beside the default choice's figure (run_all's). A call of its own (TUNED_S, default
            # 500 s, half for each type: 24 builds one at a time, each compiling its candidates on every
            # core; the choices stay in the kernel cache, so a second call on a warm machine goes on from them)
        f="$out/gemm-tuned.txt"
        echo "# benchmarks/gpu/gemm.py --search-space 2, $(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null)" \
            > "$f"
        for dt in float16 bfloat16; do
            echo "== $dt" >> "$f"
            timeout $((${TUNED_S:-500} / 2)) python3 benchmarks/gpu/gemm.py --search-space 2 --dtypes "$dt" \
                --json "$out/gemm-tuned-$dt.json" >> "$f" 2>&1
        done
        grep -E "^== |gemm_vs_cublas_min|WRONG|rror" "$f"
        ;;
    pdl)  # programmatic dependent launch (RFC 0005 decisions 29, 48): its GPU test, GPT-2 small vs
          # torch.compile, then the GEMMs plain and with it against cuBLAS (under 8 minutes)
        timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_gpu_runtime.py -k programmatic \
            2>&1 | tee "$out/gpu-suite.txt" | tail -5
        pdl_models 250
        pdl_gemms 120
        ;;
    ncu)  # ours and cuBLAS's kernels under Nsight Compute: device_session.sh ncu [gemm.py args], e.g.
          # `--m 8192 --shapes gpt2.fc2 --dtypes float16 --config sk128x128` (a stream-K kernel)
        shift
        [ $# -gt 0 ] || set -- --m 1024 --shapes gpt2 --dtypes float16
        ncu_gemm 400 ncu-gemm.txt "$@"
        ;;
    bf16models)  # models that are bfloat16 themselves (a bfloat16 checkpoint exported as it is; session 34:
                 # compiled in their own type, attention fused, head stored [N, K]) against torch eager and
                 # torch.compile on the same bfloat16 modules; never run on a GPU yet
        mkdir -p /tmp/sf-export-bf16
        timeout 400 python3 benchmarks/gpu/models.py --models gpt2_small,llama --batches 1,8 --model-dtype bfloat16 \
            --compile-modes reduce-overhead --export-dir /tmp/sf-export-bf16 --json "$out/models-bf16.json" \
            > "$out/models-bf16.txt" 2>&1
        tail -20 "$out/models-bf16.txt"
        ;;
    f16models)  # models that are float16 themselves: every activation half on both sides (the default run
                # keeps ours float32 between products); causal masks as is_causal since session 53
                # (rfcs/0005 decision 70: before, the float16 mask was a bias the kernel read)
        mkdir -p /tmp/sf-export-f16
        timeout 400 python3 benchmarks/gpu/models.py --models gpt2_small,llama --batches 1,8 --model-dtype float16 \
            --compile-modes reduce-overhead --export-dir /tmp/sf-export-f16 --json "$out/models-f16.json" \
            > "$out/models-f16.txt" 2>&1
        tail -20 "$out/models-f16.txt"
        ;;
    llama7b)  # Llama-2-7B's shapes (6.7 G parameters, float16, written by tests/models/synth_llama.py on the
              # machine, about a minute) on one GPU at 1x128 and 8x128 against torch eager and torch.compile
              # (reduce-overhead) on LlamaForCausalLM holding the same weights; never run on a GPU yet. Needs
              # about 45 GB of GPU memory (the float32 reference, then half of it) and 30 GB of host memory
        mkdir -p /tmp/sf-export-7b
        timeout 540 python3 benchmarks/gpu/models.py --models llama7b --batches 1,8 --model-dtype float16 \
            --compile-modes reduce-overhead --interleave 5 --export-dir /tmp/sf-export-7b \
            --json "$out/models-llama7b.json" > "$out/models-llama7b.txt" 2>&1
        tail -20 "$out/models-llama7b.txt"
        ;;
    tf32)  # float32 operands on the wgmma template (optimization_config["wgmma_fp32"], rfcs/0005 decisions 33-34,
           # session 41; never run on a GPU):
           # its GPU tests (every tile; the models against onnxruntime), then every GEMM shape in TF32
           # against cuBLAS's TF32 (B stored [N, K]), float32 ones (3xTF32, decision 34) against its
           # SGEMM, then GPT-2 small at tf32 against torch.compile with allow_tf32, into $out/tf32.txt,
           # < 9 min
        f="$out/tf32.txt"
        echo "# device_session.sh tf32, $(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null)" > "$f"
        timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/codegen/test_wgmma.py \
            tests/codegen/test_attention.py tests/runtime/test_gpu_runtime.py -k "tf32" 2>&1 | tail -8 | tee -a "$f"
        timeout 120 python3 benchmarks/gpu/gemm.py --dtypes tf32 --jobs 14 >> "$f" 2>&1
        # float32-accurate: 3xTF32 on the wgmma template (decision 34) against cuBLAS's SGEMM
        echo "== gemm.py --dtypes float32" >> "$f"
        timeout 90 python3 benchmarks/gpu/gemm.py --dtypes float32 --m 1024,8192 --jobs 14 >> "$f" 2>&1
        echo "== models.py gpt2_small --precision tf32 --wgmma-fp32" >> "$f"
        mkdir -p /tmp/sf-export
        timeout 150 python3 benchmarks/gpu/models.py --models gpt2_small --batches 1,8 --precision tf32 \
            --wgmma-fp32 --compile-modes reduce-overhead --export-dir /tmp/sf-export >> "$f" 2>&1
        tail -30 "$f"
        ;;
    attention)  # the fused attention kernel on float32 operands, split-KV and packed GQA (rfcs/0005
                # decisions 35, 36, 39, sessions 42-43; never run on a GPU): their GPU tests (every case:
                # halves, 3xTF32 and TF32, against the definition), then benchmarks/gpu/attention.py
                # (every type, GPT-2's and Llama-7B's heads, causal, 1x128 to 1x4096 and decoding steps
                # over 4096 keys; Llama 3 8B's grouped heads decoding; against torch's
                # scaled_dot_product_attention), into $out/attention.txt
        f="$out/attention.txt"
        echo "# device_session.sh attention, $(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null)" > "$f"
        timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/codegen/test_attention.py \
            -k "matches_the_definition" 2>&1 | tail -5 | tee -a "$f"
        timeout 150 python3 benchmarks/gpu/attention.py --jobs 14 --json "$out/attention.json" >> "$f" 2>&1
        # grouped heads packed in a block's rows for decoding (decision 39): Llama 3 8B's 32 over 8
        echo "== attention.py --shapes llama3_8b" >> "$f"
        timeout 60 python3 benchmarks/gpu/attention.py --shapes llama3_8b --sizes 1x1x4096,8x1x4096,1x4x4096 \
            --dtypes float16,bfloat16 --jobs 14 --json "$out/attention-gqa.json" >> "$f" 2>&1
        # a head size that is not a multiple of 16 (decision 50: Stable Diffusion 1.5's 40, padded to 48)
        echo "== attention.py --shapes sd15" >> "$f"
        timeout 60 python3 benchmarks/gpu/attention.py --shapes sd15 --sizes 1x1024,2x4096 \
            --dtypes float16,float32 --jobs 14 --json "$out/attention-sd15.json" >> "$f" 2>&1
        grep -E "passed|failed| ours |WRONG|rror" "$f"
        ;;
    conv)  # Stable Diffusion 1.5 UNet's convs at batch 2 (benchmarks/gpu/conv.py, session 49; never run on a
           # GPU): the batched 1x1 convs' and the channels-last convs' GPU tests (rfcs/0005 decisions 55 and
           # 57: wgmma, the images as the batch; windows gathered from a channels-last copy), then ours
           # (the 3x3 convs: copy + gathered conv, and the NCHW wmma kernel of before) vs torch's conv2d
           # (cuDNN; NCHW and channels-last), float16 and bfloat16, with ResNeXt's and RegNet's grouped 3x3
           # convs (decision 62: a product per group) and 2x2 transposed convs (decision 65), < 4 min
        f="$out/conv.txt"
        echo "# device_session.sh conv, $(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null)" > "$f"
        timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/codegen/test_wgmma.py \
            tests/codegen/test_channels_last.py -k "batched_one_by_one or channels_last" 2>&1 | tail -5 | tee -a "$f"
        timeout 180 python3 benchmarks/gpu/conv.py --jobs 14 --json "$out/conv.json" >> "$f" 2>&1
        grep -E "passed|failed| ours |WRONG|rror" "$f"
        ;;
    cnn)  # ResNet-50 end to end at batch 1 and 8 vs torch eager and torch.compile on the same module in
          # float16 and channels-last (benchmarks/gpu/cnn.py, sessions 50-51; never run on a GPU): every conv on
          # the wgmma template, activations channels-last between them (rfcs/0005 decisions 55-61). First
          # exported in float16 (like for like: half activations on both sides), then the float32 export
          # with float16 products at batch 8, beside its program with channels_last false, < 9 min
        f="$out/cnn.txt"
        echo "# device_session.sh cnn, $(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null)" > "$f"
        timeout 270 python3 benchmarks/gpu/cnn.py --model-dtype float16 --no-nchw --budget-s 250 \
            --json "$out/cnn16.json" >> "$f" 2>&1
        timeout 250 python3 benchmarks/gpu/cnn.py --batches 8 --compile-modes reduce-overhead --budget-s 230 \
            --json "$out/cnn.json" >> "$f" 2>&1
        grep -E "compiled|ours|torch|vs_torch|rror" "$f"
        ;;
    regnet)  # RegNetY-4GF end to end (cnn.py --model regnet, session 52; never run on a GPU): grouped 3x3 convs
             # of 64 channels a group as a product per group (rfcs/0005 decision 62), exported in float16, at
             # batch 1 and 8 vs torch eager and torch.compile in float16 and channels-last, < 5 min
        f="$out/regnet.txt"
        echo "# device_session.sh regnet, $(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null)" > "$f"
        timeout 280 python3 benchmarks/gpu/cnn.py --model regnet --model-dtype float16 --budget-s 260 \
            --json "$out/regnet.json" >> "$f" 2>&1
        grep -E "compiled|ours|torch|vs_torch|rror" "$f"
        ;;
    decode)  # fewer than 16 rows (compiler/codegen/cuda_gemv.py, session 39; never run on a GPU): the GEMV
             # tests, then GPT-2's and Llama-7B's projections at 1, 4 and 8 rows against cuBLAS in float16 with
             # the weight stored [K, N] and [N, K], then 4-bit codes (MatMulNBits) against cuBLAS on the
             # same weights in float16 (benchmarks/gpu/lowbit.py), into $out/decode.txt
        f="$out/decode.txt"
        echo "# device_session.sh decode, $(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null)" > "$f"
        timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/codegen/test_cuda_kernels.py \
            tests/runtime/test_gpu_runtime.py -k "MatMulNBits or extra or low_bit" 2>&1 | tail -5 | tee -a "$f"
        for layout in kn nk; do
            echo "== gemm.py --m 1,4,8 --b-layout $layout" >> "$f"
            timeout 100 python3 benchmarks/gpu/gemm.py --m 1,4,8 --dtypes float16 --b-layout $layout --jobs 14 \
                >> "$f" 2>&1
        done
        echo "== lowbit.py" >> "$f"
        timeout 120 python3 benchmarks/gpu/lowbit.py --m 1,4,8,16 --shapes gpt2,llama7b --jobs 14 \
            --json "$out/decode-lowbit.json" >> "$f" 2>&1
        grep -E "^==|passed|failed| ours |WRONG|rror" "$f"
        ;;
    steps)  # decoding steps end to end (benchmarks/gpu/decode.py, session 43; never run on a GPU): a 0.6B
            # Llama-style model with grouped heads exported in float16, its KV cache (4096 positions) kept
            # on the device, against torch eager and torch.compile on the same module, batches 1 and 8,
            # into $out/steps.txt and steps.json (< 8 min, most of it export and torch.compile)
        f="$out/steps.txt"
        echo "# device_session.sh steps, $(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null)" > "$f"
        timeout 420 python3 benchmarks/gpu/decode.py --batches 1,8 --budget-s 360 --json "$out/steps.json" \
            >> "$f" 2>&1
        tail -12 "$f"
        ;;
    run)  # any command in this environment: device_session.sh run CMD ARGS...
        shift
        "$@"
        ;;
    *)
        echo "usage: $0 lease|suite|bench|all|newtiles|sweep [TILE...]|kmajor|ncu [ARGS...]|cpu|pdl|bf16models|f16models|llama7b|decode|steps|cluster|tf32|attention|run CMD..." >&2
        exit 2
        ;;
esac
