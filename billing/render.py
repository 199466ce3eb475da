"""Invoices as a standalone HTML page and as a PDF (fpdf2), from the JSON view."""

from __future__ import annotations

import html
import logging
from pathlib import Path
from typing import Any

from fpdf import FPDF

# fpdf2 subsets the TrueType font through fontTools, which logs ~37 INFO lines per render (tables it
# skips or keeps): nothing an operator acts on, written into the server's log and the CLI's stderr.
# Its warnings and errors still show.
logging.getLogger("fontTools").setLevel(logging.WARNING)

# A Unicode TrueType font when the system has one; otherwise the PDF core font (Latin-1 only).
FONT_DIRS = (Path("/usr/share/fonts/truetype/dejavu"), Path("/usr/share/fonts/dejavu"), Path("/usr/local/share/fonts"))


def _date(iso: str | None) -> str:
    return iso[:10] if iso else ""


def _unit(line: dict[str, Any]) -> str:
    unit = line["unit_price_per_million"]
    return f"${unit} / 1M" if unit is not None else "not priced"


def _title(invoice: dict[str, Any]) -> str:
    return f"Invoice {invoice['number']}"


def render_html(invoice: dict[str, Any]) -> str:
    e = html.escape
    rows = "\n".join(
        f"<tr><td>{line['position']}</td><td>{e(line['description'])}</td><td>{e(line['usage_period'])}</td>"
        f"<td class=n>{line['tokens']:,}</td><td class=n>{e(_unit(line))}</td><td class=n>${e(line['amount'])}</td></tr>"
        for line in invoice["lines"]
    )
    versions = "\n".join(
        f"<li>{e(v['model'])}: ${e(v['input_per_million'])} input, "
        + (f"${e(v['cached_input_per_million'])} cached input, " if v.get("cached_input_per_million") else "")
        + f"${e(v['output_per_million'])} output per 1M tokens"
        + (f" (price version {v['price_version']['id']} from {e(_date(v['price_version']['effective_from']))})" if v.get("price_version") else "")
        + (f" (override {v['override']['id']}: {e(v['override']['kind'])})" if v.get("override") else "")
        + "</li>"
        for v in invoice["price_versions"]
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(_title(invoice))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem; color: #222; }}
table {{ border-collapse: collapse; width: 100%; }}
th, td {{ border-bottom: 1px solid #ddd; padding: .4rem; text-align: left; vertical-align: top; }}
td.n, th.n {{ text-align: right; white-space: nowrap; }}
tfoot td {{ font-weight: bold; border-top: 2px solid #222; }}
</style></head>
<body>
<h1>{e(_title(invoice))}</h1>
<p>Account: <strong>{e(invoice['account_name'])}</strong> (id {invoice['account_id']})<br>
Period: {e(invoice['period'])} ({e(_date(invoice['period_start']))} to {e(_date(invoice['period_end']))}, end exclusive, UTC)<br>
Status: {e(invoice['status'])}<br>Issued: {e(_date(invoice['created_at']))}</p>
<table>
<thead><tr><th>#</th><th>Description</th><th>Usage period</th><th class=n>Tokens</th><th class=n>Unit price</th><th class=n>Amount</th></tr></thead>
<tbody>
{rows}
</tbody>
<tfoot><tr><td colspan=5>Total ({e(invoice['currency'].upper())})</td><td class=n>${e(invoice['total'])}</td></tr></tfoot>
</table>
<h2>Prices used</h2>
<ul>
{versions}
</ul>
<p>Each line is tokens x unit price, rounded half up to the cent once; the total is the sum of the lines.</p>
</body></html>
"""


def _font(pdf: FPDF) -> tuple[str, bool]:
    for folder in FONT_DIRS:
        regular, bold = folder / "DejaVuSans.ttf", folder / "DejaVuSans-Bold.ttf"
        if regular.exists() and bold.exists():
            pdf.add_font("DejaVu", "", str(regular))
            pdf.add_font("DejaVu", "B", str(bold))
            return "DejaVu", True
    return "Helvetica", False


def render_pdf(invoice: dict[str, Any]) -> bytes:
    pdf = FPDF(format="A4")
    pdf.set_title(_title(invoice))
    pdf.set_creator("Tollgate")
    family, unicode = _font(pdf)

    def text(value: str) -> str:
        return value if unicode else value.encode("latin-1", "replace").decode("latin-1")

    pdf.add_page()
    pdf.set_font(family, "B", 16)
    pdf.cell(0, 10, text(_title(invoice)), new_x="LMARGIN", new_y="NEXT")
    pdf.set_font(family, "", 10)
    for label, value in (
        ("Account", f"{invoice['account_name']} (id {invoice['account_id']})"),
        ("Period", f"{invoice['period']} ({_date(invoice['period_start'])} to {_date(invoice['period_end'])}, end exclusive, UTC)"),
        ("Status", invoice["status"]),
        ("Issued", _date(invoice["created_at"])),
    ):
        pdf.cell(0, 6, text(f"{label}: {value}"), new_x="LMARGIN", new_y="NEXT")
    pdf.ln(4)
    pdf.set_font(family, "", 8)
    with pdf.table(col_widths=(6, 74, 16, 22, 24, 18), text_align=("LEFT", "LEFT", "LEFT", "RIGHT", "RIGHT", "RIGHT")) as table:
        table.row(["#", "Description", "Period", "Tokens", "Unit price", "Amount"])
        for line in invoice["lines"]:
            table.row([
                str(line["position"]), text(line["description"]), line["usage_period"], f"{line['tokens']:,}",
                text(_unit(line)), f"${line['amount']}",
            ])
    pdf.ln(3)
    pdf.set_font(family, "B", 11)
    pdf.cell(0, 8, text(f"Total: ${invoice['total']} {invoice['currency'].upper()}"), align="R", new_x="LMARGIN", new_y="NEXT")
    pdf.set_font(family, "", 8)
    pdf.multi_cell(0, 5, "Each line is tokens x unit price, rounded half up to the cent once; the total is the sum of the lines.")
    return bytes(pdf.output())
