"""The operations of one compiled decode step per setting, counted from the graph Dynamo hands its backend (a toy Llama of the 8B structure, 2 layers, CPU, the kernel path in the interpreter):

    POLICYZOO_TRITON=1 TRITON_INTERPRET=1 python benchmarks/results/2026-12-06-h100-run34/step_ops.py dense,quest0.1,quest0.1-sketch,quest0.1-nominate4
"""
import collections, os, sys
import torch
from benchmarks import common
graphs = []
def backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward
model = common.random_model("llama-3.1-8b", 2, tiny=True, device="cpu")
for name in sys.argv[1].split(","):
    graphs.clear()
    torch._dynamo.reset()
    dec = common.decoder(model, name).compile(backend=backend, regional=False)
    ids = torch.randint(1, 100, (1, 300))
    dec.generate(ids, 3, eos_token_id=model.config.vocab_size - 1)
    c = collections.Counter()
    for gm in graphs[-1:]:
        for n in gm.graph.nodes:
            if n.op == "call_function":
                c[str(n.target).replace("aten.", "").split(".default")[0]] += 1
    print(f"== {name}: {sum(c.values())} ops in the last graph ({len(graphs)} graphs)")
    print("   ", ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]) if "policyzoo" in k or v >= 4))
