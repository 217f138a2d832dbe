"""CPU kernels below the model: the integer-dot matmuls, decode attention and sampling's temper (qdot.py over
qdot.cpp, built for this CPU on first use) and the measured choices between them (plans.py). Nothing here imports the
model; the model, the sampler and the device defaults import from here."""
