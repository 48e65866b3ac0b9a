"""What ``compile`` and ``concurrent`` make of one step (GPU): a 2-layer Llama of width 64,
greedy, 8 new tokens, called three ways in one process, printing each call's step nodes, longest
path and new tokens, with the ``grape`` logger's capture lines.

Written to check, on a GPU, that ``compile=True`` alone runs its step as a chain (948359f) and to
show what asking for ``concurrent=True`` as well makes: on an H100 at f926a52 the eager step 117
nodes (85 on its longest path), compiled 59 (59), compiled and concurrent 133 (93), the tokens
equal (``benchmarks/results/gpu_h100_f926a52/compile_default.log``).

Run on a GPU: python benchmarks/compiled_step_nodes.py
"""

import logging

import torch
import transformers

import grape
from grape.torch.api import last_stats

logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=500)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).cuda().eval()
ids = torch.randint(3, 500, (1, 5), device="cuda")
for kw in ({}, {"compile": True}, {"compile": True, "concurrent": True}):
    out = grape.generate(model, ids, max_new_tokens=8, do_sample=False, **kw)
    s = last_stats()
    print(kw, "graphed", s.graphed, "compiled", s.compiled, "nodes", s.step_nodes, "depth",
          s.step_depth, out[0, -8:].tolist(), flush=True)
