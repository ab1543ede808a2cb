import atexit, time, collections, threading
from shoal.operator import kube, metrics, controller
stats = collections.defaultdict(lambda: [0, 0.0])
orig = kube.Kube.request
def timed(self, method, path, **kw):
    t = time.perf_counter()
    try:
        return orig(self, method, path, **kw)
    finally:
        key = method + " " + "/".join(p for p in path.split("/")[:7])
        stats[key][0] += 1; stats[key][1] += time.perf_counter() - t
kube.Kube.request = timed
orig_rec = controller.Controller._reconcile
def rec(self, *a, **k):
    t = time.perf_counter()
    try: return orig_rec(self, *a, **k)
    finally: print("RECONCILE %.3f" % (time.perf_counter() - t), time.strftime("%X"))
controller.Controller._reconcile = rec
def dump():
    for k, (n, t) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        print("PROF %-80s %4d %.3f" % (k, n, t / n))
atexit.register(dump)
