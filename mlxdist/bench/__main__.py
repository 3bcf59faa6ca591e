from mlxdist.bench.harness import main

main()
