"""The checks and plans of scripts/device_check.py: what a lent GPU machine runs, by plan
name (``python -m scripts.device_check --list`` prints them). Each check is a shell command
run from the repository root with ``$OUT`` the folder that comes back, and its own timeout."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    command: str  # a shell command run from the repository root; $OUT is the output folder
    timeout: int  # seconds


PY = "python3 -m"
# the 80B's config with 64 experts per layer, every one on the GPU at the whole budget
Q64 = ("python3 -c \"import json; c = json.load(open('configs/models/qwen3-next-80b-a3b.json'));"
       " c['num_experts'] = 64; json.dump(c, open('/tmp/q64.json', 'w'))\"")
# the CPU experts' shards kept between a command's runs ([experts] shard_cache): each run is a
# fresh server still, but only the first quantizes the 70 GiB of CPU experts
SHARDS = "--set experts.shard_cache=/dev/shm/tbc-shards "


def coding_check(name: str, arms: str) -> Check:
    """bench_concurrency's coding loops at 32 GiB, 3 turns of 64 tokens, ``arms`` (off first:
    it records the replay file) in one pair: runs to ``$OUT/concurrency/32c``, the work folder
    (logs, records, replay file) packed beside them. The prefix cache has an 8 GiB host tier
    (configs/qwen3-next-80b.toml's): the agents' checkpoints the GPU's 1 GiB cannot keep."""
    return Check(name, "mount -o remount,size=110G /dev/shm; timeout -k 15 560 "
                 f"{PY} scripts.bench_concurrency --model qwen3-next-80b-a3b --gpu-budget 32 "
                 f"--proposer replay --replay-source mtp {SHARDS}"
                 "--set scheduler.prefix_cache_host_mb=8192 "
                 f"--arms {arms} --pairs 1 --workloads coding --coding-turns 3 "
                 "--coding-tokens 64 --out-dir $OUT/concurrency/32c "
                 f"--work-dir /tmp/tbc-32x; rc=$?; tar czf $OUT/{name}_work.tar.gz "
                 "--exclude='./model-*' -C /tmp/tbc-32x .; exit $rc", 585)


def essay_warm(budget: str, seconds: int) -> Check:
    """bench_concurrency's essays at GPU budget ``budget`` (32 or whole) with the arms off, wide
    and adaptive in ``seconds``: runs to ``$OUT/concurrency/<budget>``, the work folder (logs,
    replay file) packed beside them, the worker's "cuda graphs" lines in graph_lines.txt."""
    work = f"/tmp/tbc-{budget}w"
    return Check(f"essay_{budget}_warm", "mount -o remount,size=110G /dev/shm; "
                 f"timeout -k 15 {seconds} {PY} scripts.bench_concurrency "
                 f"--model qwen3-next-80b-a3b --gpu-budget {budget} "
                 f"--proposer replay --replay-source mtp {SHARDS}"
                 "--arms off,wide,adaptive --pairs 1 --workloads essay --essay-tokens 128 "
                 f"--time-budget {seconds - 10} --out-dir $OUT/concurrency/{budget} "
                 f"--work-dir {work}; rc=$?; "
                 f"grep -h '\"cuda graphs\"' {work}/*.log > $OUT/graph_lines.txt; "
                 f"tar czf $OUT/essay_{budget}_work.tar.gz --exclude='./model-*' -C {work} .; "
                 "exit $rc", seconds + 45)


def workload_ab(name: str, arms: str, pairs: int = 4, seconds: int = 540,
                workload: str = "essay") -> Check:
    """``workload`` (essay: 128 tokens; coding: 3 turns of 64) at 32 GiB, ``arms``, up to
    ``pairs`` pairs (resumable on a warm machine), the carried replay file where there is one
    (else the first run records it: an off run); runs and step traces in $OUT/<name>.tar.gz
    (any card)."""
    work = f"/tmp/tbc-{name}"
    return Check(name, f"mount -o remount,size=110G /dev/shm; mkdir -p {work}/out "
                 f"{work}/work; cp .matrix/32/work/replay_{workload}.json {work}/work/ "
                 f"2>/dev/null; timeout -k 15 {seconds} {PY} scripts.bench_concurrency --model "
                 f"qwen3-next-80b-a3b --gpu-budget 32 --proposer replay --replay-source mtp "
                 f"{SHARDS}--set scheduler.prefix_cache_host_mb=8192 --arms {arms} "
                 f"--pairs {pairs} --resume --workloads {workload} --essay-tokens 128 "
                 f"--coding-turns 3 --coding-tokens 64 --time-budget {seconds - 20} "
                 f"--out-dir {work}/out --work-dir {work}/work; rc=$?; tar czf "
                 f"$OUT/{name}.tar.gz -C {work} --exclude='model-*' "
                 "--exclude='*.records.jsonl' out work; exit $rc", seconds + 45)


# the matrix's runs resume across calls and machines, so another card's would pass for the
# H200's: refused unless MATRIX_ANY_GPU=1, then kept apart (/tmp/m<budget>-other, .matrix/..-other)
H200_ONLY = ("sfx=; if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then "
             "[ -n \"$MATRIX_ANY_GPU\" ] || { echo 'not an H200 (MATRIX_ANY_GPU=1 runs it anyway, "
             "in /tmp/m*-other)'; exit 3; }; sfx=-other; fi; ")
# the matrix run's time limit and budget: the check's seconds (device_check's CHECK_SECONDS)
# less the rate's measure, the kill's grace and the tars; MATRIX_LIMIT/_BUDGET override
MATRIX_TIMES = ("lim=${MATRIX_LIMIT:-$((${CHECK_SECONDS:-595} - 55))}; "
                "bud=${MATRIX_BUDGET:-$((lim - 30))}; ")


def matrix(budget: str, arms: str = "off,narrow,wide,adaptive", name: str = "",
           workloads: str = "essay,coding") -> Check:
    """Issue 15's whole matrix at GPU budget ``budget`` (32 or whole): essays and coding,
    off, narrow, wide and adaptive, three pairs, resumable across calls: the runs stay in
    /tmp/m<budget> (-other: another card's, H200_ONLY) on a warm machine; a fresh one restores
    them from the carried ``.matrix/<budget>[-other]/{out,work}`` (earlier calls' tars unpacked
    there: docs/benchmarks.md). Each call measures this machine's CPU expert rate (~30 s, once
    per machine), starts no run it cannot finish in its time (MATRIX_TIMES) and returns every
    run so far ($OUT/matrix_<budget>_out.tar.gz) and the work folder's replay files, records
    and logs ($OUT/matrix_<budget>_work.tar.gz). ``arms`` other than the default (the fixed
    draft lengths) go into the same folders: the off runs are shared."""
    m, keep = f"/tmp/m{budget}$sfx", f".matrix/{budget}$sfx"  # (H200_ONLY's suffix)
    rate = f"{m}/cpu_rate.json"  # this machine's, measured by its first call (never carried)
    measure = CPU_INT8_RATE.command.replace("$OUT/cpu_experts_int8_1row.json", rate)
    return Check(name or f"matrix_{budget}", "mount -o remount,size=110G /dev/shm; "
                 f"{H200_ONLY}mkdir -p {m}/out {m}/work; if [ -d {keep} ]; then "
                 f"cp -n {keep}/out/*.json {m}/out/ 2>/dev/null; "
                 f"cp -n {keep}/work/* {m}/work/ 2>/dev/null; fi; "
                 f"[ -s {rate} ] || {measure}; cp {rate} {m}/work/cpu_experts_int8_1row.json; "
                 f"{MATRIX_TIMES}timeout -k 15 $lim "
                 f"{PY} scripts.bench_concurrency --model qwen3-next-80b-a3b --gpu-budget {budget} "
                 f"--dram-gbs {m}/work/cpu_experts_int8_1row.json "
                 f"--proposer replay --replay-source mtp {SHARDS}"
                 f"--set scheduler.prefix_cache_host_mb=8192 --arms {arms} "
                 f"--pairs 3 --workloads {workloads} --essay-tokens 128 --coding-turns 3 "
                 "--coding-tokens 64 --resume --time-budget $bud "
                 f"--out-dir {m}/out --work-dir {m}/work; rc=$?; "
                 f"tar czf $OUT/matrix_{budget}_out.tar.gz -C {m}/out .; "
                 f"tar czf $OUT/matrix_{budget}_work.tar.gz --exclude='./model-*' -C {m}/work .; "
                 "exit $rc", 595)


# issue 17's 16-row ratio: one int4 expert, and the top-10 experts every row shares (per
# expert, every thread busy), at 1 and 16 rows
INT4_RATIO = Check("int4_ratio", f"{PY} scripts.bench_cpu_experts --format int4 "
                   "--combos 512:512 --topks 10 --rows 1,16 --kinds one_expert,shared "
                   "--out $OUT/cpu_experts_int4_ratio.json", 90)
# issue 17: does the machine's per-thread vector rate fall as threads are added (seconds),
# with the machine's own account of its cores beside it
PROBE = Check("probe", f"lscpu; {PY} scripts.probe_cpu_scaling --threads 1,2,4,8,12,15,16 "
              "--out $OUT/cpu_scaling.json", 60)
# the graph tests: eager bits, capacity buckets, MTP drafting graphs, CPU experts' counts
STEP_GRAPHS = Check("step_graphs", f"{PY} pytest -q -p no:cacheprovider "
                    "tests/gpu/test_step_graph_cupy.py", 150)
# the fused kernels checked on the emulator only (q/k norm + RoPE, the GDN gates in the
# conv kernel, the gated norm), and the launched ring (real CPU workers) against host dispatch
FUSED = Check("fused", f"{PY} pytest -q -p no:cacheprovider tests/gpu/test_fused_norm_cupy.py "
              "tests/gpu/test_qk_norm_rope_cupy.py "
              "tests/gpu/test_gdn_kernel_cupy.py tests/gpu/test_cpu_link.py", 120)
# the start of every plan for a scarce device (first, second, third)
SCARCE = [PROBE, FUSED, INT4_RATIO, STEP_GRAPHS]
# the synthetic 80B's step at 32 GiB, int8 GPU experts, buckets on (issue 14's first table)
STEP_32_INT8 = Check("step_32_int8", "mount -o remount,size=110G /dev/shm; rm -rf "
                     f"/dev/shm/tbc-shards; {PY} scripts.bench_step --model qwen3-next-80b-a3b "
                     "--gpu-budget 32 --gpu-format int8 --graphs --steps 5 "
                     "--out $OUT/step_int8_32gib.json", 280)
# the floor's rates measured on this machine in the same call (docs/benchmarks.md): the int8
# CPU expert pool at one row, random top-10 (the DRAM rate), and a 4 GiB read on the GPU
CPU_INT8_RATE = Check("cpu_int8_rate", f"{PY} scripts.bench_cpu_experts --format int8 "
                      "--combos 512:512 --topks 10 --rows 1 --kinds random "
                      "--out $OUT/cpu_experts_int8_1row.json", 90)
RATES = "--dram-gbs $OUT/cpu_experts_int8_1row.json --hbm-tbs measure "
STEP_WHOLE = Check("step_whole", f"{PY} scripts.bench_step --model qwen3-next-80b-a3b "
                   "--gpu-budget whole --graphs --steps 5 --out $OUT/step_whole.json", 300)
BATCH_INVARIANCE = Check("batch_invariance", f"{PY} pytest -q -s -p no:cacheprovider "
                         "tests/gpu/test_batch_invariance_cupy.py", 200)
SPECULATION_BF16 = Check("speculation_bf16", f"{PY} pytest -q -p no:cacheprovider "
                         "tests/gpu/test_speculation_bf16_cupy.py", 240)
TABLES = [CPU_INT8_RATE,
          Check("step_32_rates", STEP_32_INT8.command.replace("--steps 5 ", "--steps 5 " + RATES),
                280),
          Check("step_whole_rates", STEP_WHOLE.command.replace("--steps 5 ", "--steps 5 " + RATES),
                300),
          Check("sampler", f"{PY} pytest -q -p no:cacheprovider tests/gpu/test_sampler_cupy.py",
                120)]
PLANS: dict[str, list[Check]] = {
    # the kernels that stay off until they pass here (gpu_worker/kernels/enabled.py)
    "kernels": [
        Check("rowtile", f"{PY} pytest -q -p no:cacheprovider tests/gpu/test_rowtile_cupy.py", 90),
        Check("gdn", f"{PY} pytest -q -p no:cacheprovider tests/gpu/test_gdn_kernel_cupy.py", 90),
        Check("paged_attention",
              f"{PY} pytest -q -p no:cacheprovider tests/gpu/test_paged_attention_cupy.py", 120),
        Check("fused_norm",
              f"{PY} pytest -q -p no:cacheprovider tests/gpu/test_fused_norm_cupy.py", 60),
        Check("fused_silu",
              f"{PY} pytest -q -p no:cacheprovider tests/gpu/test_fused_silu_cupy.py", 60),
        Check("router", f"{PY} pytest -q -p no:cacheprovider tests/gpu/test_router_cupy.py", 60),
        BATCH_INVARIANCE,
    ],
    "parity": [
        Check("bf16_gguf", f"{PY} pytest -q -p no:cacheprovider tests/gpu/test_bf16_cupy.py "
              "tests/gpu/test_gguf_cupy.py", 200),
    ],
    # the 32 GiB load of issue 13 (needs the tandem command on PATH and a large /dev/shm)
    "load": [
        Check("load_32", "mount -o remount,size=110G /dev/shm; cp docs/bench/load_h200.json "
              "$OUT/load_h200.json; " + f"{PY} scripts.bench_load --model qwen3-next-80b-a3b "
              "--gpu-budget 32 --append --ready-timeout 240 --out $OUT/load_h200.json", 330),
    ],
    "int4": [
        # the AVX-512 VNNI paths' bits (skipped on machines without them), then speed
        Check("int4_bits", f"{PY} pytest -q -p no:cacheprovider -o addopts= "
              "tests/unit/test_cpu_int4.py tests/unit/test_cpu_int4_rows.py "
              "tests/unit/test_int4_alignment.py tests/unit/test_cpu_kernels.py", 300),
        Check("int4_diag", f"{PY} scripts.bench_cpu_kernels_inprocess --diag "
              "--out $OUT/int4_diag.json", 120),
        # one expert's stages in-process, VNNI against AMX tiles (the H200 machine has AMX)
        Check("int4_stages", f"{PY} scripts.bench_cpu_kernels_inprocess --stages --format int4 "
              "--isa avx512vnni --isa amx --out $OUT/int4_stages.json", 120),
        Check("int4", f"{PY} scripts.bench_cpu_experts --format int8,int4 --combos 512:512 "
              "--topks 10 --kinds random,one_expert --out $OUT/cpu_experts_int4_h200.json", 180),
    ],
    # the synthetic 80B's step with CUDA graphs against its floor, both budgets (issue 14)
    "step": [
        Check("step_32", "mount -o remount,size=110G /dev/shm; cp docs/bench/step_graphs_h200.json "
              "$OUT/step_graphs_h200.json; " + f"{PY} scripts.bench_step --model "
              "qwen3-next-80b-a3b --gpu-budget 32 --graphs --steps 5 --append "
              "--out $OUT/step_graphs_h200.json", 280),
        Check("step_whole", f"{PY} scripts.bench_step --model qwen3-next-80b-a3b --gpu-budget "
              "whole --graphs --steps 5 --append --out $OUT/step_graphs_h200.json", 300),
    ],
    # what the capacity buckets' padding costs: the padded layouts at the whole GPU (where
    # the GPU's side of a step weighs most), padded and with one graph per rows (exact)
    "buckets": [
        Check("buckets_whole", f"{PY} scripts.bench_step --model qwen3-next-80b-a3b "
              "--gpu-budget whole --graphs --steps 5 --layouts 1x3,1x5,2x3,3x1,3x3,3x5 "
              "--out $OUT/step_buckets_whole.json", 240),
        Check("exact_whole", f"{PY} scripts.bench_step --model qwen3-next-80b-a3b "
              "--gpu-budget whole --graphs --no-graph-buckets --steps 5 "
              "--layouts 1x3,1x5,2x3,3x1,3x3,3x5 --out $OUT/step_exact_whole.json", 240),
    ],
    # what MTP drafting adds to a decode step, eager and as one CUDA graph (gpu_worker/
    # mtp_graph.py): the synthetic 80B given an MTP head, whole GPU, 1-4 slots x 3 drafts
    "mtp": [
        Check("mtp_whole", "mount -o remount,size=110G /dev/shm; "
              f"{PY} scripts.bench_mtp --model qwen3-next-80b-a3b --gpu-budget whole "
              "--drafts 3 --out $OUT/mtp_whole.json", 300),
        Check("mtp_tests", f"{PY} pytest -q -p no:cacheprovider tests/gpu/test_bench_mtp_cupy.py "
              "tests/gpu/test_step_graph_cupy.py -k mtp", 180),
    ],
    # the GPU alone: the 80B's widths with 64 experts per layer (all on the GPU), its step
    # with graphs, then one eager step per layout under Nsight Compute (docs/benchmarks.md)
    "gpu_only": [
        Check("step_q64", f"{Q64}; {PY} scripts.bench_step --model /tmp/q64.json --gpu-budget "
              "whole --graphs --steps 5 --out $OUT/step_gpu_only_h200.json", 150),
        Check("profile_q64", f"{Q64}; ncu --profile-from-start off --clock-control none "
              "--metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --log-file "
              f"$OUT/ncu_q64.csv {PY} scripts.profile_step --model /tmp/q64.json --gpu-budget "
              f"whole --layouts 1x1,4x4 && {PY} scripts.profile_step --summarize "
              "$OUT/ncu_q64.csv --out $OUT/step_kernel_profile_h200.json && gzip -f "
              "$OUT/ncu_q64.csv", 240),
    ],
    # the row-tile products as graphs (device time), 8-16 rows also as tiles of 4 and 8 rows
    "linear": [
        Check("linear", f"{PY} scripts.bench_linear --graph --dtypes bf16 --tiles 4,8 "
              "--out $OUT/linear_graph_h200.json", 180),
    ],
    # the quick correctness checks of a tree whose default CuPy path changed: row-tile,
    # router, input stacks (bits equal unstacked) and graphs (bits equal eager)
    "quick": [
        Check("quick", f"{PY} pytest -q -p no:cacheprovider tests/gpu/test_rowtile_cupy.py "
              "tests/gpu/test_router_cupy.py tests/gpu/test_input_stacks_cupy.py "
              "tests/gpu/test_step_graph_cupy.py", 200),
    ],
    # paged attention and RMSNorm (+ the fused residual add) against their references, then
    # every layout's bits (set TANDEM_INVARIANCE_LAYOUTS=sample:N to bound it)
    "attn_norm": [
        Check("attn_norm", f"{PY} pytest -q -p no:cacheprovider "
              "tests/gpu/test_paged_attention_cupy.py tests/gpu/test_fused_norm_cupy.py", 150),
        BATCH_INVARIANCE,
    ],
    # one call after kernel changes (about 400 s warm): the changed kernels' tests, the
    # model's paths (input stacks, graphs), every layout's bits (set
    # TANDEM_INVARIANCE_LAYOUTS=sample:3000), bf16 speculation, attention's speed, the GPU step
    "validate": [
        Check("kernels_changed", f"{PY} pytest -q -p no:cacheprovider "
              "tests/gpu/test_paged_attention_cupy.py tests/gpu/test_fused_norm_cupy.py "
              "tests/gpu/test_fused_silu_cupy.py tests/gpu/test_moe_merged_cupy.py", 150),
        Check("model_paths", f"{PY} pytest -q -p no:cacheprovider "
              "tests/gpu/test_input_stacks_cupy.py tests/gpu/test_step_graph_cupy.py", 150),
        Check("batch_invariance", f"{PY} pytest -q -s -p no:cacheprovider "
              "tests/gpu/test_batch_invariance_cupy.py", 120),
        Check("speculation_bf16", f"{PY} pytest -q -p no:cacheprovider "
              "tests/gpu/test_speculation_bf16_cupy.py", 90),
        Check("attention", f"{PY} scripts.bench_attention --partitions 64 "
              "--out $OUT/attention_h200.json", 60),
        Check("step_q64", f"{Q64}; {PY} scripts.bench_step --model /tmp/q64.json --gpu-budget "
              "whole --graphs --steps 5 --out $OUT/step_gpu_only_h200.json", 120),
    ],
    # issue 15's concurrency benchmark, the smallest meaningful run: the synthetic 80B at
    # 32 GiB, essays, replay drafts, off (records the replay file) then narrow and wide, one
    # pair, a fresh server each (~110 s load + ~40 s warm-up, workload and stop: ~450 s).
    # The run JSONs and summary.json come back in $OUT/concurrency_h200/32; the configs,
    # server logs, records and replay file in one tar (docs/benchmarks.md, on the H200)
    "concurrency": [
        Check("concurrency_32", "mount -o remount,size=110G /dev/shm; timeout -k 15 500 "
              f"{PY} scripts.bench_concurrency --model qwen3-next-80b-a3b --gpu-budget 32 "
              f"--proposer replay --replay-source mtp {SHARDS}"
              "--arms off,narrow,wide --pairs 1 "
              "--workloads essay --essay-tokens 128 --time-budget 490 "
              "--out-dir $OUT/concurrency_h200/32 --work-dir /tmp/tbc-h200-32; rc=$?; "
              "tar czf $OUT/concurrency_h200_32_work.tar.gz --exclude='./model-*' "
              "-C /tmp/tbc-h200-32 .; exit $rc", 525),
    ],
    # issue 15's coding workload at 32 GiB, one run per command (--budget 590; ~6.5 min a run
    # there by the 6-turn run's pace, not yet measured): this one records the plain run and
    # its replay file; later commands carry $OUT/concurrency_h200/32 and the work folder
    # back and add one arm each with --resume and --arms off,<arm> (docs/benchmarks.md)
    "coding_32": [
        Check("coding_off_32", "mount -o remount,size=110G /dev/shm; timeout -k 15 560 "
              f"{PY} scripts.bench_concurrency --model qwen3-next-80b-a3b --gpu-budget 32 "
              f"--proposer replay --replay-source mtp {SHARDS}"
              "--arms off --pairs 1 --workloads coding "
              "--coding-turns 4 --coding-tokens 64 --time-budget 550 "
              "--out-dir $OUT/concurrency_h200/32 --work-dir /tmp/tbc-h200-32c; rc=$?; "
              "tar czf $OUT/coding_32_work.tar.gz --exclude='./model-*' "
              "-C /tmp/tbc-h200-32c .; exit $rc", 585),
    ],
    # the exactness of a multi-turn workload (session 19: narrow's third coding turn differed
    # from off's until fa5112b and c2c7d0c), and the history checkpoints' prefix-cache hits
    # (prompt_cached_tokens): coding off then narrow at 32 GiB, 3 turns (~420 s cold)
    "coding_exact": [coding_check("coding_exact_32", "off,narrow")],
    # the same with wide (issue 15's coding ratio, 3 turns: ~470 s cold)
    "coding_wide": [coding_check("coding_wide_32", "off,narrow,wide")],
    # issue 15's matrix, one call after another (--budget 590 each): see matrix()
    "matrix_32": [matrix("32")],
    "matrix_whole": [matrix("whole")],
    # the fixed draft lengths beside adaptive (issue 15: adaptive >= the best of them); with
    # four streams, plain wide's drafts are trimmed to 3 a slot (16 rows): wide stands for wide@3
    "matrix_32_fixed": [matrix("32", "off,wide@1,wide@2", "matrix_32_fixed")],
    # the adaptive budget's host work per step with the route buffers on the GPU
    "host_times": [Check("draft_budget_host", f"{PY} scripts.bench_draft_budget --device "
                         "--out $OUT/draft_budget_host_device.json", 60)],
    # the essays' question first (one call): adaptive beside the fixed lengths 1 and 2
    "matrix_32_essay": [matrix("32", "off,adaptive,wide@2,wide@1", "matrix_32_essay", "essay")],
    "pin_ab": [workload_ab("pin_ab", "adaptive,adaptive+nopin,wide@3,wide@3+nopin", 2)],
    # the budget against the best fixed length of four streams (16 rows: 3 drafts a slot)
    "budget_ab": [workload_ab("budget_ab", "adaptive,wide@3", 6)],
    # the same on the coding loops (their replay file recorded by the first call's off run)
    "coding_ab": [workload_ab("coding_ab", "adaptive,wide@3,wide@2", 3, workload="coding")],
    # the coding arms in calls after another (its off runs record the coding replay file)
    "matrix_32_coding": [matrix("32", "off,narrow,wide,adaptive,wide@2,wide@1",
                                "matrix_32_coding", "coding")],
    # a prefill chunk's rows several to a warp (session 20): the kernels' bits (decode rows
    # and R-row launches), the model's chunking and every-layout invariance with both
    # architectures and the GPU experts' row cap, then each launch shape's speed
    "prefill": [
        Check("paged_attention", f"{PY} pytest -q -p no:cacheprovider "
              "tests/gpu/test_paged_attention_cupy.py", 300),  # 150 s cut it (session 20)
        Check("prefill_speed", f"{PY} scripts.bench_attention --prefill "
              "--out $OUT/prefill_attention.json", 120),
        Check("invariance", f"{PY} pytest -q -s -p no:cacheprovider "
              "tests/gpu/test_batch_invariance_cupy.py tests/gpu/test_moe_merged_cupy.py", 280),
    ],
    # essays at 32 GiB with every verify layout captured at start-up (gpu_worker/
    # graph_warm.py; its GPU tests are in plan "graphs"): off records the replay file, wide
    # and adaptive should replay from their first pass (steps.cuda_graph_passes and start of
    # each run file); the worker's "cuda graphs" log lines go to $OUT/graph_lines.txt.
    # Pass --budget 580; a later command adds narrow with --arms off,narrow --resume and the
    # out and work folders carried back
    "warm_32": [essay_warm("32", 530)],
    # the same at the whole GPU (issue 15's second budget; $OUT/concurrency/whole)
    "warm_whole": [essay_warm("whole", 530)],
    # AMX against VNNI on one int4 expert, alternately in one process, then the AMX tests
    "amx": [
        Check("amx_vnni", f"{PY} scripts.bench_amx_vnni --rounds 5 --threads 16,8 "
              "--out $OUT/amx_vnni.json", 240),
        Check("amx_tests", f"{PY} pytest -q -p no:cacheprovider -o addopts= "
              "tests/unit/test_cpu_amx.py tests/unit/test_cpu_int4_rows.py "
              "tests/unit/test_cpu_kernels.py -k 'amx or AMX or tiles_equal'", 180),
    ],
    # issue 17's 16-row ratio: does the machine's per-thread vector rate fall with threads
    # busy (scripts/probe_cpu_scaling.py), and the VNNI kernel's own scaling beside it
    "cpu_scaling": [
        PROBE,
        INT4_RATIO,
        Check("vnni_threads", f"{PY} scripts.bench_amx_vnni --isa avx512vnni --rounds 3 "
              "--threads 1,2,4,8,16 --out $OUT/vnni_threads.json", 240),
    ],
    "probe": [PROBE],
    # one call when the device is scarce (--budget 575): the probe, the int4 ratio, the graph
    # tests (buckets and MTP graphs included), then essays at 32 GiB in what is left (off,
    # wide, adaptive)
    "first": [*SCARCE, essay_warm("32", 300)],
    # an H200 that may be taken back mid-call: three short calls (--budget 450-540 each)
    # instead of one long one, each worth keeping alone. 1: issue 17's machine facts and
    # ratio, issue 14's 32 GiB table; 2: the whole-GPU table and every layout's bits;
    # 3: the fused kernels, the graphs, bf16 speculation and the prefix cache's host tier
    "h200_1": [PROBE, INT4_RATIO, STEP_32_INT8],
    # issue 14's tables against this machine's own rates (~330 s on an H100 machine), and
    # the GPU sampling tests (10,000 rows bit for bit, the chi-square)
    "tables": TABLES,
    "h200_2": [STEP_WHOLE, BATCH_INVARIANCE],
    # issue 14 in one call (--budget 570, ~500 s on an H100 machine): the tables against the
    # machine's own rates, GPU sampling, every layout's bits, bf16 speculation, graphs = eager
    "issue14": [*TABLES, BATCH_INVARIANCE, SPECULATION_BF16, STEP_GRAPHS],
    # the first call on an H200 (--budget 575): issue 17's machine facts and 16-row ratio
    # (35 s), then issue 14's call; what does not fit is skipped, last first
    "h200": [PROBE, INT4_RATIO, *TABLES, BATCH_INVARIANCE, SPECULATION_BF16, STEP_GRAPHS],
    "h200_3": [FUSED, STEP_GRAPHS, SPECULATION_BF16,
               Check("prefix_host", f"{PY} pytest -q -p no:cacheprovider "
                     "tests/gpu/test_prefix_host_cupy.py", 60)],
    # CUDA graphs (gpu_worker/step_graph.py): bits equal eager, with and without CPU experts,
    # capacity buckets included (their scratch slot's GDN segments: table slot -1)
    "graphs": [
        Check("gdn", f"{PY} pytest -q -p no:cacheprovider tests/gpu/test_gdn_kernel_cupy.py", 90),
        Check("graphs", f"{PY} pytest -q -p no:cacheprovider tests/gpu/test_topk_cupy.py "
              "tests/gpu/test_synthetic_routing_cupy.py tests/gpu/test_synthetic_cupy.py "
              "tests/gpu/test_step_graph_cupy.py", 300),
        # speculation exact in bf16 over > 2,000 tokens per architecture (issue 14)
        SPECULATION_BF16,
    ],
}
