"""Train tandem-tiny: a small Qwen3-Next MoE (transformers' ``Qwen3NextForCausalLM``) plus an MTP
head, jointly, and save it in the real Qwen3-Next on-disk format.

Needs the ``train`` extra (torch, transformers); nothing in Tandem's runtime imports this
package. Run from the repository root as ``python -m scripts.train SUBCOMMAND``; the
sub-commands (see ``docs/training.md`` for the full recipe) and their modules:

* ``prepare``      (data.py) tokenize a corpus from ``scripts/build_corpus.py`` into uint16
  streams,
* ``train``        (loop.py) train (or resume) on CPU or CUDA under a wall-clock budget, save a
  checkpoint,
* ``export``       (checkpoint.py) merge a checkpoint's shards into
  ``models/tandem-tiny/model.safetensors``,
* ``evaluate``     (losses.py) held-out perplexity (code / prose / chat) and MTP agreement,
* ``reference``    (reference.py) write ``reference_logits.npz`` (float32 logits of
  transformers and of the MTP head),
* ``sample``       (reference.py) greedy chat completion, to eyeball the model,
* ``compile-rate`` (compile_rate.py) greedy function-body completions of held-out functions
  (transformers, CPU),
* ``finetune-ul``  (finetune.py, unlikelihood.py) sequence-level unlikelihood + self-training
  fine-tuning on the model's own greedy completions (GPU), checkpoints chosen on the
  validation functions,
* ``interpolate``  (checkpoint.py) weight-space interpolation of two checkpoints (WiSE-FT),
* ``validate``     (compile_rate.py) strict compile figures on the validation functions
  (held-out minus the headline 100), batched greedy decoding with transformers.

The compile-rate rule itself lives in ``scripts/compile_rule.py``, shared with
``scripts/eval_tiny_model.py``.
"""
