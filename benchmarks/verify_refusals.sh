#!/usr/bin/env bash
# On the GPU: verify refuses a sum-reduced loss, a token mean without count= and a BatchNorm split,
# and passes the correct token mean; the script turns TF32 on (verify holds it off). Margins in the JSON.
G="--n-layer 4 --n-embd 512 --n-head 8 --block-size 1024 --vocab 32768 --samples 256 --micro-batch 8 --accumulation 4 --val-cache-mib 16 --dropout 0.1 --tf32 --loss-outside"
V="python3 -m autobalance verify --device cuda --runs-dir /tmp/v --trial-timeout 120 --json"
run() { name=$1; shift; /usr/bin/time -f "$name wall %e s" timeout 150 $V "$@" > $OUT/verify_$name.json 2>> $OUT/verify_stderr.txt; echo "$name rc=$?";
  python3 -c "import json,sys; d=json.load(open('$OUT/verify_$name.json')); print('  passed', d['passed'], d.get('failure'), 'floor', d.get('floor'), 'bound', d.get('bound'), [(c['name'], c['grad_rel']) for c in d['checks']])" 2>&1 | tail -1; }
run token-count examples/gpt/train.py --config benchmarks/2026-12-03-h200/c16x2.json -- $G --variable-length
run token-no-count examples/gpt/train.py --config benchmarks/2026-12-03-h200/c16x2.json -- $G --variable-length --no-count
run sum-loss examples/gpt/train.py --config benchmarks/2026-12-03-h200/c16x2.json -- $G --sum-loss
run batchnorm tests/scripts/user_train.py --config benchmarks/2026-12-03-h200/c4x4.json -- --norm batch --tf32
grep -h "wall" $OUT/verify_stderr.txt
