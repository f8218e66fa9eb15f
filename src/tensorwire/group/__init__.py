from .group import Group

__all__ = ["Group"]
