"""Can a warm start find a kernel function its templates never ran by name, in the module of
one they did run (``cuFuncGetModule`` then ``cuModuleGetFunction``), instead of capturing the
shape that runs it (GPU)?

Wav2Vec2-base over 101 audio lengths: every length captured; the functions of every 15th
length stand for a warm start's templates; each function the others run is looked up by name
in the templates' modules. Run on the H200 (``results/families_alternates_h200/
function_modules_a0705e7.log``): 2 of 38 found; cuBLAS's nvjet GEMMs each live in a module of
their own (76 modules for 100 functions), so the lookup would not spare the captures, and
``load_family`` learns functions from captures instead (``learn_functions``).

Run on a GPU: python benchmarks/function_modules.py
"""

import torch  # noqa: F401 - CUDA initialised before the driver is asked
from cuda.bindings import driver
from families import wav2vec2_audio

from grape.cuda.functions import resolve
from grape.ir import Kernel
from grape.torch.capture import capture

lengths = list(range(16000, 160001, 1440))
w = wav2vec2_audio(lengths)
funcs = {}  # length -> set of function idents
for n in lengths:
    cap = capture(lambda n=n: w.step(n), params=w.params, instantiate=False, collect=False)
    funcs[n] = {op.function for _, op in cap.ir.ops() if isinstance(op, Kernel)}

def module(ident):
    err, m = driver.cuFuncGetModule(resolve(ident))
    return (int(m), m) if err == driver.CUresult.CUDA_SUCCESS else (None, err)

templates = lengths[::15]
known = set().union(*(funcs[n] for n in templates))
mods = {}
errs = 0
for f in known:
    key, m = module(f)
    if key is None:
        errs += 1
    else:
        mods[key] = m
allf = set().union(*funcs.values())
new = allf - known
print(f"functions: all {len(allf)}, in templates {len(known)}, new {len(new)}, "
      f"template modules {len(mods)}, cuFuncGetModule errors {errs}")
found = ambiguous = missing = wrong = 0
for f in sorted(new):
    name = f.rsplit("@", 1)[0]
    hits = []
    for m in mods.values():
        err, h = driver.cuModuleGetFunction(m, name.encode())
        if err == driver.CUresult.CUDA_SUCCESS:
            hits.append(int(h))
    own, _ = module(f)
    if len(hits) == 1 and hits[0] == int(resolve(f)):
        found += 1
    elif len(hits) > 1:
        ambiguous += 1
    elif hits:
        wrong += 1
        print("  other handle:", name[:80])
    else:
        missing += 1
        where = 'known' if own in mods else own
        print(f"  not in template modules: {name[:90]} (own module {where})")
print(f"new functions found by name in a template's module: {found}; ambiguous {ambiguous}; "
      f"other handle {wrong}; not found {missing}")
allmods = {module(f)[0] for f in allf}
print(f"modules over all functions: {len(allmods)}")
