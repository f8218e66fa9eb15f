"""Sphinx configuration of the API reference (`make docs` builds it into build/docs).

The pages are MyST markdown; the entries come from the docstrings of the importable package, so
the reference cannot drift from the code. Docstrings write code as `name` (markdown style):
`default_role` renders that as code instead of RST's italics.
"""

project = "tensorwire"
author = "tensorwire developers"
extensions = ["sphinx.ext.autodoc", "myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
default_role = "code"
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
add_module_names = False
html_theme = "alabaster"
html_title = "tensorwire API reference"
html_show_sourcelink = False
html_copy_source = False


def _no_constructor(app, what, name, obj, options, signature, return_annotation):
    """Users get groups, Work and the torch classes from the library and never construct them:
    a class shows no constructor signature (it would be an internal one). Errors keep theirs."""
    if what == "class":
        return "", None
    return None


def setup(app):
    app.connect("autodoc-process-signature", _no_constructor)
