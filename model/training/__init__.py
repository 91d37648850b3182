"""Train, export and try out kvchat's shipped model (assets/kvchat-mini).

    python -m kvchat.model.training data   --data /tmp/kvchat-train/data      # corpus + tokenizer
    python -m kvchat.model.training train  --data ... --run /tmp/kvchat-train/run [--resume]
    python -m kvchat.model.training export --data ... --run ... --out assets/kvchat-mini
    python -m kvchat.model.training sample --model assets/kvchat-mini [--markdown FILE]
    python -m kvchat.model.training eval   --data ... --model assets/kvchat-mini  # val loss, ppl
    python -m kvchat.model.training bench  --model assets/kvchat-mini    # TTFT, decode tok/s
    python -m kvchat.model.training all    --data ... --run ... --out ...  # data+train+export

Everything is deterministic for a seed: the corpus (model/training/corpus.py), the tokenizer,
the packing of conversations into rows, the order of batches (a pure function of the
step, so --resume continues exactly), and the initial weights.

On a CPU, preload OpenBLAS first (MLX CPU matmuls are ~30x faster with it; `kvchat`
loads it itself, these scripts do not):
    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
and, where `kvchat --version` says kvchat chose the kernels (an OpenBLAS older than the
CPU falls back to its 3-5x slower generic "Prescott" ones), `OPENBLAS_CORETYPE` set to
the set it names.
"""

# data.py: corpus -> tokenizer -> packed rows; loop.py: the model and the training loop;
# export.py: the 4-bit model folder; sample.py: replies, speed and loss of a folder;
# __main__.py: the command line.
