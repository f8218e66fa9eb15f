"""tensorwire: collective communication for distributed AI and HPC."""
