"""GPU backends behind one interface: NVML on real hardware, a simulated GPU with the hardware's rules."""
