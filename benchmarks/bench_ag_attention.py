"""``python -m benchmarks.bench_attention cp`` under the name GPU runs and scripts use, with the same flags."""

import sys

from benchmarks.bench_attention import main

if __name__ == "__main__":
    main(["cp", *sys.argv[1:]])
