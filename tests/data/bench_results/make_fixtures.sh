#!/bin/sh
# Re-records the benchmark result files of this directory with the released tools' own clients and writers
# (see README.md). Needs a scratch venv (never the checkout's) holding vllm==0.34.0 --no-deps with
# engines-requirements.txt, sglang==0.5.23 --no-deps with the modules its client imports, and aiperf 0.13.0;
# VENV and AIPERF name their bin/ directories.
set -eu
VENV=${VENV:?scratch venv with vllm 0.34.0 and sglang 0.5.23}
AIPERF=${AIPERF:?scratch venv with aiperf 0.13.0}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
"$VENV/bin/python" "$HERE/make_tokenizer.py" "$WORK/tok"
"$VENV/bin/python" "$HERE/stub_server.py" 18943 > "$WORK/stub.log" 2>&1 &
STUB=$!
trap 'kill $STUB' EXIT
sleep 3
URL=http://127.0.0.1:18943
"$VENV/bin/vllm" bench serve --backend vllm --base-url $URL --model stub --tokenizer "$WORK/tok" \
  --dataset-name random --random-input-len 1024 --random-output-len 64 --num-prompts 16 --max-concurrency 4 \
  --seed 0 --save-result --save-detailed --result-dir "$WORK" --result-filename vllm-bench-serve-c4-detailed.json
"$VENV/bin/vllm" bench serve --backend vllm --base-url $URL --model stub --tokenizer "$WORK/tok" \
  --dataset-name random --random-input-len 1024 --random-output-len 64 --num-prompts 32 --max-concurrency 16 \
  --seed 0 --save-result --result-dir "$WORK" --result-filename vllm-bench-serve-c16.json
for c in 2 8; do
  "$VENV/bin/vllm" bench serve --backend vllm --base-url $URL --model stub --tokenizer "$WORK/tok" \
    --dataset-name random --random-input-len 2048 --random-output-len 32 --num-prompts $((c * 2)) \
    --max-concurrency $c --seed 0 --append-result --result-dir "$WORK" --result-filename vllm-bench-serve-append.json
done
for c in 4 16; do
  "$VENV/bin/python" "$HERE/run_sglang_bench.py" --backend vllm --base-url $URL --model stub --tokenizer "$WORK/tok" \
    --dataset-name random-ids --random-input-len 1024 --random-output-len 64 --random-range-ratio 1.0 \
    --num-prompts $((c * 4)) --max-concurrency $c --seed 0 --output-file "$WORK/sglang-bench-serving.jsonl"
done
"$AIPERF/bin/aiperf" profile --model stub --url $URL --endpoint-type completions --streaming --concurrency 4 \
  --request-count 16 --isl 1024 --osl 64 --tokenizer "$WORK/tok" --artifact-dir "$WORK/aiperf" --random-seed 0 --ui none
cp "$WORK"/vllm-bench-serve-*.json "$WORK/sglang-bench-serving.jsonl" "$HERE/"
cp "$WORK/aiperf/profile_export_aiperf.json" "$HERE/aiperf-c4-profile_export_aiperf.json"
