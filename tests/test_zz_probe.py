import collections
def test_probe(hosts):
    fails = collections.Counter(); texts = {}
    for i in range(150):
        p = hosts.mpirun([0, 1, 2], ["-c", "pass"], module=None, timeout=60)
        if p.returncode:
            key = (p.returncode, (p.stdout + p.stderr)[:300])
            fails[key[0]] += 1; texts[key[0]] = p.stdout + p.stderr
    print(fails)
    for k, t in texts.items():
        print(k, t[-3000:])
