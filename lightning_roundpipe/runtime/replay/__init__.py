"""What recomputation must replay exactly: dropout RNG and MoE routing."""
