"""Every `conveyor bench …`: offline throughput, priority and preemption, serving over HTTP,
the gateway's overhead and the GPU kernel checks, with their shared helpers. Serving code never
imports this package (the CLI finds it by name).
"""
