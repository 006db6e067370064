#!/bin/bash
# The hybrid (7 PaTH layers 3,7,...,27; the other 23 the source's attention, local: window 8192, 4 renumbered sinks)
# recovered with the shipped recipe (recipes/configs/smollm2-135m-cpu.yaml, same data and stages). The screening run
# stopped at the end of its 512-token stages (step 320, 163,840 tokens): target_ratio 2 is met at the first evaluation,
# which eval_every puts at step 320. The full-budget run (286,720 tokens, ../hybrid-full/) resumed it from its step-320
# checkpoint through the 2048-token stages: the second command. Run from the repository root after `make smollm2`'s
# fetch step. (The screening run was stopped by a signal at step 99 and resumed with training.resume=true; the recipe's
# resume is exact, so it is this run.)
set -e
source .venv/bin/activate
path-hf convert --from runs/smollm2/download/SmolLM2-135M-Instruct.Q4_1.gguf --to runs/hybrid/converted \
  --rope interleave --init default --forget-gate --forget-gate-bias 6 --layers 3,7,11,15,19,23,27 \
  --local-window 8192 --local-sinks 4 --verify
OMP_NUM_THREADS=2 accelerate launch --cpu --num_processes 1 --num_machines 1 --mixed_precision no \
  --dynamo_backend no recipes/train.py --config recipes/configs/smollm2-135m-cpu.yaml \
  model.path=runs/hybrid/converted "model.convert={}" model.teacher=runs/smollm2/download/SmolLM2-135M-Instruct.Q4_1.gguf \
  training.output_dir=runs/hybrid/train training.target_ratio=2.0 training.eval_every=320
cp -r runs/hybrid/train/final runs/hybrid/final-320  # the screening run's model
OMP_NUM_THREADS=2 accelerate launch --cpu --num_processes 1 --num_machines 1 --mixed_precision no \
  --dynamo_backend no recipes/train.py --config recipes/configs/smollm2-135m-cpu.yaml \
  model.path=runs/hybrid/converted "model.convert={}" model.teacher=runs/smollm2/download/SmolLM2-135M-Instruct.Q4_1.gguf \
  training.output_dir=runs/hybrid/train training.target_ratio=null training.resume=true
