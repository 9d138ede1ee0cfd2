def pytest_configure(config):
    config.addinivalue_line(
        "markers", "reference_trainer: real-DeepSpeed reference trainer / checkpoint generation (CPU, mpirun; minutes)")
