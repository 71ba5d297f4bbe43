#!/bin/bash
# Round 2's queue (one job at a time), from the repository root: bash docs/research/small-state/run_round2.sh
cd "$(dirname "$0")/../../.."
export PYTHONPATH=src OMP_NUM_THREADS=1
D=docs/research/small-state
while [ ! -e /tmp/full2/done ]; do sleep 60; done
echo "start $(date)"
NEW=P:M8sr:m8t:V8t,P:M8sr:m6:v6,P:M8sr:m7:v5,P:M8sr:m8:v5,P:M8sr:m5:v6,P:M8sr:m5:v7,P:M8sr:m6b:v6,P:M8sr:m6:v6b,P:M8sr:m7:v5b,P:M8sr:m8:v6,P:M8sr:m6:V8,P:M8sr:m5:V8,P:M8sr:m8:v7,P:M8sr:m7:V8
nice -n 10 python3 $D/train.py --task digits --seeds 0-4 --modes $NEW; echo "digits done $(date)"
nice -n 10 python3 $D/fo_check.py; echo "fo_check done $(date)"
nice -n 10 python3 $D/probes.py ${NEW//,/ }; echo "probes done $(date)"
nice -n 10 python3 $D/train.py --task char-lm --modes fp32,compact,P:M8sr:m8:V8; echo "char done $(date)"
nice -n 10 python3 $D/probes.py flashoptim; echo "fo probes done $(date)"
nice -n 10 python3 $D/train.py --task digits --steps 3000 --schedule cosine --seeds 0 --modes P:M8sr:m8t:V8t,P:M8sr:m6:v6,P:M8sr:m7:v5,P:M8sr:m8:v5,P:M8sr:m5:v6,P:M8sr:m5:v7; echo "cosine done $(date)"
nice -n 10 python3 $D/train.py --task digits --seeds 0-4 --modes flashoptim; echo "fo digits done $(date)"
echo "all done $(date)"
