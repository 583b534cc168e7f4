"""Reports shared by compare, doctor and bench: self-contained HTML pages, PNG figures, JSON.

Kept free of torch: it turns numbers into files.
"""

from mixprec.report.html import HtmlReport
from mixprec.report.figures import figure_to_png, new_figure, save_png

__all__ = ["HtmlReport", "figure_to_png", "new_figure", "save_png"]
