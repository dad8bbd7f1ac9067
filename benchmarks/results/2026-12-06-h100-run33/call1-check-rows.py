import torch, itertools
from policyzoo import kernels
from policyzoo.kernels import reference as ref
from policyzoo.kernels.ops.sketch_page_bound import SketchScoreConfig
from policyzoo.kernels.config import override
DEV = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
worst = 0
for (b, hkv, g, P, page, d, agg, bp, listed) in [(1,2,4,8,16,128,"max",4,False),(2,1,3,5,16,64,"none",2,False),(1,2,1,3,4,8,"max",4,False),
                                             (2,2,5,7,16,80,"none",4,True),(1,1,2,4,16,7,"max",4,False),(1,2,4,9,16,128,"none",8,True)]:
    keys = torch.randn(b,hkv,P,page,d)*2 + torch.randn(b,hkv,P,1,d)
    mn, mx = keys.amin(3).bfloat16(), keys.amax(3).bfloat16()
    codes = ref.sketch_encode(keys, mn, mx).flatten(2,3).contiguous()
    q = torch.randn(b,hkv*g,d).bfloat16()
    length = torch.tensor(P*page-5); start = torch.tensor([3]*b)
    ids = torch.randint(-1, P+1, (b,hkv,6)).int() if listed else None
    keys, q, start, length = keys.to(DEV), q.to(DEV), start.to(DEV), length.to(DEV)
    mn, mx, codes = mn.to(DEV), mx.to(DEV), codes.to(DEV)
    ids = ids.to(DEV) if ids is not None else None
    with override(sketch_score=SketchScoreConfig(method="rows", block_p=bp)):
        got = kernels.sketch_page_bound.triton(q,codes,mn,mx,start,length,d**-0.5,agg,ids)
    want = ref.sketch_page_bound(q,codes,mn,mx,start,length,d**-0.5,agg,ids)
    assert torch.equal(got.isneginf(), want.isneginf()), (got, want)
    live = want.isfinite()
    err = ((got-want)[live].abs().max() / (1 + want[live].abs().max())).item()
    worst = max(worst, err)
    print(d, agg, listed, "max rel err", err)
print("worst", worst)
