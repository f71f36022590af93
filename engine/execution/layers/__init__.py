"""The building blocks every decoder family is made of (nano-vllm's `layers/`).

- `linear`: dense linear layers (oneDNN-packed on CPU), column- or row-parallel, each knowing
  which rows or columns of which checkpoint tensors it holds (`Linear.load`);
- `quantized`: the same projections over quantized blocks, and the native decoder stack;
- `norm`: RMSNorm, plain or fused with the residual add; LayerNorm (GPT-NeoX, Phi, StableLM);
- `rotary`: the rotary tables of one RoPE configuration, full or partial;
- `attention`: attention over the paged KV cache (rotation, cache write, decode and prefill
  kernels, sliding windows and soft-capping), and the per-step metadata;
- `activation`: the gated MLP activations;
- `moe`: top-k routed experts.

A model file (engine/execution/models/) only arranges these; the checkpoint is read into them by
engine/loading/weights.py.
"""
