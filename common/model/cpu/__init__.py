"""The CPU backend: the C kernels (csrc/, built per instruction set at install time), their
loader, and the product kernels and their chooser."""
