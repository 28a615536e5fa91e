import json, numpy as np, collections
from pathlib import Path
from bench.fidelity import simulated, grid_of, empirical_service
from jaxserve.profiler import load_cost_model
from jaxserve.datasets import load_tweets
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.registry import minilm_dir
d=json.load(open("/tmp/cal.json")); by=d["by"]
cost = load_cost_model(Path("compiled_cache/cost_model.json")); grid=grid_of(cost,"minilm-l6")
tok = TextTokenizer(minilm_dir() / "tokenizer.json")
texts,_ = load_tweets(); rng=np.random.default_rng(0); pool=[texts[i] for i in rng.choice(len(texts),4000,replace=False)]
ids = [tok.truncate(x, grid.max_length) for x in tok.encode(pool)]; plen=np.array([len(x) for x in ids])
def dedupe(c):
    g={}
    for s,m,h in c: g.setdefault((s,m),[]).append(h)
    return [(s,m,float(np.mean(h))) for (s,m),h in g.items()]
cal=dedupe(d["out"]["cal"]["computed"])
prof=np.array([by[s] for s,_,_ in cal]); meas=np.array([m for _,m,_ in cal])/1e3; held=np.array([h for *_,h in cal])/1e3
ratios=meas/prof; hand=np.maximum(held-meas,0)
print("cal batches", len(cal), "ratio mean %.3f hand mean ms %.3f"%(ratios.mean(), hand.mean()*1e3))
run=d["out"]["run"]; arr=np.array(run["arr"]); pick=np.array(run["pick"])
sim=simulated(cost,grid,arr,plen[pick],0.0,service_time=empirical_service(cost,ratios,hand,7))
lat=sim.latencies()*1e3; s=np.array(run["server"])
rc=dedupe(run["computed"])
print("sim mean %.2f p98 %.2f batches %d mean batch %.2f util %.2f"%(lat.mean(),np.percentile(lat,98),len(sim.batch_count),sim.mean_batch_size(),sim.utilization()))
print("live mean %.2f p98 %.2f batches %d"%(s.mean(),np.percentile(s,98),len(rc)))
print("sim cells", collections.Counter(sim.cell_batch[sim.batch>=0][np.unique(sim.batch[sim.batch>=0],return_index=True)[1]].tolist()))
print("live cells", collections.Counter(int(x[0].split('_')[0][1:]) for x in rc))
print("live percentiles", [round(np.percentile(s,p),1) for p in (50,75,90,95,98,99)])
print("sim percentiles", [round(np.percentile(lat,p),1) for p in (50,75,90,95,98,99)])
rh=np.array([h for *_,h in rc]); print("live busy s %.2f, sim busy s %.2f"%(rh.sum()/1e3, (sim.batch_finish-sim.batch_start).sum()))
# correlation: per-request (server latency, ratio, hand)
c=run["computed"]; srv=s
r=np.array([m/1e3/by[sh] for sh,m,_ in c]) if False else None
