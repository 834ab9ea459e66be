"""The typed records every layer hands every other; imports nothing of gpuguardd but the shared leaves."""
