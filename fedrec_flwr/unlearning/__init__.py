"""Server-side unlearning algorithms, pure PyTorch (no Flower): Krylov solvers (CG, Steihaug trust region,
line search), the influence objective and its curvature, and the membership-margin step.
"""
