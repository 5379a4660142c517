"""The benchmarks behind `lowbit bench NAME`: each module has main(argv) and prints its figures."""
