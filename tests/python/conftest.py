def pytest_configure(config):
    config.addinivalue_line(
        "markers", "reference_trainer: real-DeepSpeed reference trainer / checkpoint generation (CPU, mpirun; minutes)")
    config.addinivalue_line("markers", "slow: takes minutes on a 2-core machine (skipped with RESHARD_TEST_QUICK=1)")
