"""Models built from the engine, and their data: the tiny GPT (gpt.py), the same models in
plain PyTorch for reference (torch_ref.py, needs torch), the embedded datasets and the
sampler every strategy shares (data.py), pruning's masks and smaller models (prune/:
magnitude, structured, low-rank), distillation's loss (distill.py), and the
mixture-of-experts layer the GPT can hold in place of its MLPs (moe/). The MLP is the
engine's own `nn.MLP`.
"""
