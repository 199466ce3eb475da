"""Invoices and credit notes as a standalone HTML page and as a PDF (fpdf2), from the JSON views.

An invoice shows the seller (from the settings, as snapshotted at issue), the buyer (the account's
billing details at issue), number, issue and due dates, terms, the lines, subtotal, the tax line,
total and amount due, and the chargebacks of its payments (each dispute's amount, date and status;
what is owed again). Without a seller identity the document says it is a usage statement, not an
invoice.
"""

from __future__ import annotations

import base64
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
STATEMENT_NOTICE = (
    "This is a usage statement, not an invoice: no seller identity (legal name, address, tax id) is configured "
    "on this gateway."
)
ROUNDING_NOTE = ("Each line is tokens x unit price (cached responses: their recorded cost at the cache-hit price), "
                 "rounded half up to the cent once; the subtotal is the sum of the lines; "
                 "tax is computed once on the subtotal and rounded half up to the cent.")


def _date(iso: str | None) -> str:
    return iso[:10] if iso else ""


def money(cents: int) -> str:
    """$1,234.56 (negative: -$1.20)."""
    sign = "-" if cents < 0 else ""
    return f"{sign}${abs(cents) // 100:,}.{abs(cents) % 100:02d}"


def _unit(line: dict[str, Any]) -> str:
    unit = line["unit_price_per_million"]
    if line.get("direction") == "cached_response":  # its amount is the hits' recorded cost
        return "cache-hit price"
    return f"${unit} / 1M" if unit is not None else "not priced"


def _title(doc: dict[str, Any]) -> str:
    if doc["object"] == "credit_note":
        return f"Credit note {doc['number']}"
    return f"{'Invoice' if doc.get('document') == 'invoice' else 'Usage statement'} {doc['number']}"


def party_lines(party: dict[str, Any] | None) -> list[str]:
    if not party:
        return []
    out = [party["legal_name"], *party.get("address", [])]
    if party.get("country"):
        out.append(party["country"])
    if party.get("tax_id"):
        out.append(f"Tax ID: {party['tax_id']}")
    if party.get("email"):
        out.append(party["email"])
    return out


def _facts(invoice: dict[str, Any]) -> list[tuple[str, str]]:
    facts = [
        ("Invoice number" if invoice.get("document") == "invoice" else "Statement number", invoice["number"]),
        ("Issue date", _date(invoice.get("issued_at"))),
    ]
    if invoice.get("due_at"):
        facts.append(("Due date", _date(invoice["due_at"])))
    if invoice.get("payment_terms"):
        facts.append(("Payment terms", invoice["payment_terms"]))
    facts += [
        ("Period", f"{invoice['period']} ({_date(invoice['period_start'])} to {_date(invoice['period_end'])}, end exclusive, UTC)"),
        ("Currency", invoice["currency"].upper()),
        ("Status", status_text(invoice)),
    ]
    if _owed_again(invoice):
        facts.append(("Charged back", _date(invoice.get("charged_back_at"))))
    return facts


def status_text(invoice: dict[str, Any]) -> str:
    """The invoice's status as a person reads it: paid by carrying its amount to the next invoice
    (below Stripe's minimum charge) is not paid by a payment, and a charged-back one is owed again."""
    if _owed_again(invoice):
        return f"{invoice['status']}, charged back"
    if invoice["status"] == "paid" and invoice.get("carried_to_next_cents"):
        return f"paid, nothing charged: {money(invoice['carried_to_next_cents'])} carried to the next invoice"
    return str(invoice["status"])


def _owed_again(invoice: dict[str, Any]) -> int:
    """What the chargebacks of a paid invoice's payments took back and is owed again (cents)."""
    return int(invoice.get("chargeback_cents") or 0) if invoice["status"] == "paid" else 0


CHARGEBACK_STATUSES = {
    "needs_response": "open", "under_review": "under review", "warning_needs_response": "inquiry", "warning_under_review": "inquiry",
    "warning_closed": "inquiry closed", "appeal_needs_response": "appealed", "appeal_under_review": "appealed", "won": "won",
    "lost": "lost", "prevented": "prevented", "unknown": "open",
}


def chargeback_lines(invoice: dict[str, Any]) -> list[str]:
    """One sentence per dispute of the invoice's payments: its amount, date, status and what it takes back."""
    out = []
    for c in invoice.get("chargebacks", []):
        status = CHARGEBACK_STATUSES.get(c["dispute_status"], c["dispute_status"].replace("_", " "))
        text = (f"Chargeback of {money(c['disputed_cents'])} {c['currency'].upper()} disputed by the cardholder's bank on "
                f"{_date(c['disputed_at'])} (dispute {status}): ")
        if c.get("settled_at"):
            settled = c["settled_cents"] if c.get("settled_cents") is not None else c["amount_cents"]
            text += f"{money(settled)} paid again on {_date(c['settled_at'])}, nothing owed"
            returned = settled - c["amount_cents"]  # given back by the bank after the settlement: paid twice
            if returned > 0:
                text += f"; {money(returned)} returned by the bank too, paid twice: "
                text += (f"{money(c['refund_due_cents'])} to be refunded to you" if c.get("refund_due_cents")
                         else f"refunded on {_date(c.get('refunded_at'))}")
        elif c["amount_cents"] > 0:
            text += f"{money(c['amount_cents'])} taken back, owed again"
        else:
            text += "nothing taken back, nothing owed"
        out.append(text)
    return out


def totals(invoice: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("Subtotal", money(invoice["subtotal_cents"]))]
    tax = invoice.get("tax")
    if tax is not None:
        rows.append((f"Tax ({tax['rate']}%)", money(tax["amount_cents"])))
    rows.append((f"Total ({invoice['currency'].upper()})", money(invoice["total_cents"])))
    if invoice.get("credit_applied_cents"):
        rows.append(("Credit balance applied", money(-invoice["credit_applied_cents"])))
    if invoice.get("carried_in_cents"):
        rows.append((CARRIED_IN, money(invoice["carried_in_cents"])))
    if invoice.get("carried_to_next_cents"):
        rows.append((CARRIED_OUT, money(-invoice["carried_to_next_cents"])))
    if invoice.get("credited_cents"):
        rows.append(("Credited by credit notes", money(-invoice["credited_cents"])))
    rows.append(("Amount due", money(max(0, invoice["amount_due_cents"] - invoice.get("credited_cents", 0)))))
    if _owed_again(invoice):
        rows.append(("Charged back, owed again", money(_owed_again(invoice))))
    if invoice.get("refund_due_cents"):
        rows.append((REFUND_DUE, money(invoice["refund_due_cents"])))
    return rows


CARRIED_IN = "Carried from earlier invoices (below the minimum charge)"
CARRIED_OUT = "Carried to the next invoice (below the minimum charge)"
REFUND_DUE = "Paid twice, to be refunded"  # a chargeback settled outside Stripe, then its dispute won


def _notes(invoice: dict[str, Any]) -> list[str]:
    out = [f"Credit note {c['number']} ({_date(c['issued_at'])}): {money(-c['total_cents'])} against this document"
           for c in invoice.get("credit_notes", [])]
    out += [f"Credit note {c['number']} ({_date(c['issued_at'])}) for invoice {c['invoice_number']}: {money(-c['total_cents'])}"
            + (" credited to your balance" if c["applies_to"] == "balance" else "")
            for c in invoice.get("credit_notes_since_last_invoice", [])]
    return out


def _logo_html(seller: dict[str, Any] | None) -> str:
    path = Path(seller["logo"]) if seller and seller.get("logo") else None
    if path is None or not path.is_file():
        return ""
    kind = "png" if path.suffix.lower() == ".png" else "jpeg"
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img class=logo alt="logo" src="data:image/{kind};base64,{data}">'


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
table { border-collapse: collapse; width: 100%; }
th, td { border-bottom: 1px solid #ddd; padding: .4rem; text-align: left; vertical-align: top; }
td.n, th.n { text-align: right; white-space: nowrap; }
.parties { display: flex; gap: 3rem; margin: 1rem 0; }
.parties div { min-width: 16rem; }
.notice { border: 2px solid #b45309; background: #fffbeb; padding: .6rem; font-weight: bold; }
table.totals { width: auto; margin-left: auto; }
table.totals tr.total td { font-weight: bold; border-top: 2px solid #222; }
img.logo { max-height: 4rem; float: right; }
dl { display: grid; grid-template-columns: max-content auto; gap: .2rem 1rem; }
dt { color: #555; }
"""


def render_html(invoice: dict[str, Any]) -> str:
    e = html.escape
    rows = "\n".join(
        f"<tr><td>{line['position']}</td><td>{e(line['description'])}</td><td>{e(line['usage_period'])}</td>"
        f"<td class=n>{line['tokens']:,}</td><td class=n>{e(_unit(line))}</td><td class=n>{money(line['amount_cents'])}</td></tr>"
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
    seller = invoice.get("seller")
    buyer = invoice.get("buyer") or {"legal_name": invoice["account_name"]}
    notice = "" if seller else f"<p class=notice>{e(STATEMENT_NOTICE)}</p>"
    facts = "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in _facts(invoice))
    total_rows = "".join(
        f"<tr{' class=total' if k.startswith('Total') or k in ('Amount due', 'Charged back, owed again', REFUND_DUE) else ''}><td>{e(k)}</td><td class=n>{e(v)}</td></tr>"
        for k, v in totals(invoice))
    notes = "".join(f"<li>{e(n)}</li>" for n in _notes(invoice))
    chargebacks = "".join(f"<li>{e(n)}</li>" for n in chargeback_lines(invoice))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(_title(invoice))}</title>
<style>{STYLE}</style></head>
<body>
{_logo_html(seller)}<h1>{e(_title(invoice))}</h1>
{notice}
<div class=parties>
<div><h3>From</h3>{'<br>'.join(e(x) for x in party_lines(seller)) or '(no seller identity configured)'}</div>
<div><h3>Bill to</h3>{'<br>'.join(e(x) for x in party_lines(buyer))}<br><small>Account {e(invoice['account_name'])} (id {invoice['account_id']})</small></div>
</div>
<dl>{facts}</dl>
<table>
<thead><tr><th>#</th><th>Description</th><th>Usage period</th><th class=n>Tokens</th><th class=n>Unit price</th><th class=n>Amount</th></tr></thead>
<tbody>
{rows}
</tbody>
</table>
<table class=totals>{total_rows}</table>
{f'<h2>Credit notes</h2><ul>{notes}</ul>' if notes else ''}
{f'<h2>Chargebacks</h2><ul id=chargebacks>{chargebacks}</ul>' if chargebacks else ''}
<h2>Prices used</h2>
<ul>
{versions}
</ul>
<p>{e(ROUNDING_NOTE)}</p>
</body></html>
"""


def render_credit_note_html(note: dict[str, Any]) -> str:
    e = html.escape
    seller = note.get("seller")
    notice = "" if seller else f"<p class=notice>{e('A credit on a usage statement: no seller identity is configured.')}</p>"
    rows = [("Credit note number", note["number"]), ("Issue date", _date(note["issued_at"])),
            ("Credits invoice", note["invoice_number"]), ("Reason", note.get("reason") or ""), ("Memo", note.get("memo") or "")]
    amounts = [("Subtotal", money(-note["subtotal_cents"])), ("Tax", money(-note["tax_cents"])),
               (f"Total credited ({note['currency'].upper()})", money(-note["total_cents"]))]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(_title(note))}</title><style>{STYLE}</style></head>
<body>{_logo_html(seller)}<h1>{e(_title(note))}</h1>{notice}
<div class=parties><div><h3>From</h3>{'<br>'.join(e(x) for x in party_lines(seller))}</div>
<div><h3>Credit to</h3>{'<br>'.join(e(x) for x in party_lines(note.get('buyer')))}</div></div>
<dl>{''.join(f'<dt>{e(k)}</dt><dd>{e(v)}</dd>' for k, v in rows)}</dl>
<table class=totals>{''.join(f'<tr><td>{e(k)}</td><td class=n>{e(v)}</td></tr>' for k, v in amounts)}</table>
<p>{'Credited to your balance; applied to your next invoice.' if note['applies_to'] == 'balance' else 'Reduces the amount due on the invoice it credits.'}</p>
</body></html>
"""


# PDF ----------------------------------------------------------------------------------------------
def _font(pdf: FPDF) -> tuple[str, bool]:
    for folder in FONT_DIRS:
        regular, bold = folder / "DejaVuSans.ttf", folder / "DejaVuSans-Bold.ttf"
        if regular.exists() and bold.exists():
            pdf.add_font("DejaVu", "", str(regular))
            pdf.add_font("DejaVu", "B", str(bold))
            return "DejaVu", True
    return "Helvetica", False


class _Pdf:
    def __init__(self, title: str) -> None:
        self.pdf = FPDF(format="A4")
        self.pdf.set_title(title)
        self.pdf.set_creator("Tollgate")
        self.family, self.unicode = _font(self.pdf)
        self.pdf.add_page()

    def text(self, value: str) -> str:
        return value if self.unicode else value.encode("latin-1", "replace").decode("latin-1")

    def line(self, value: str, size: int = 10, bold: bool = False, height: float = 5.5, align: str = "L") -> None:
        self.pdf.set_font(self.family, "B" if bold else "", size)
        self.pdf.cell(0, height, self.text(value), align=align, new_x="LMARGIN", new_y="NEXT")

    def wrapped(self, value: str, size: int = 8, bold: bool = False) -> None:
        self.pdf.set_font(self.family, "B" if bold else "", size)
        self.pdf.multi_cell(0, 4.5, self.text(value), new_x="LMARGIN", new_y="NEXT")

    def header(self, title: str, seller: dict[str, Any] | None) -> None:
        logo = Path(seller["logo"]) if seller and seller.get("logo") else None
        if logo is not None and logo.is_file():
            self.pdf.image(str(logo), x=150, y=10, h=16)
        self.line(title, 16, bold=True, height=10)

    def parties(self, left: tuple[str, list[str]], right: tuple[str, list[str]]) -> None:
        top = self.pdf.get_y() + 2
        for x, (label, lines) in ((10, left), (110, right)):
            self.pdf.set_xy(x, top)
            self.pdf.set_font(self.family, "B", 9)
            self.pdf.cell(90, 5, self.text(label), new_x="LEFT", new_y="NEXT")
            self.pdf.set_font(self.family, "", 9)
            for value in lines:
                self.pdf.cell(90, 4.5, self.text(value), new_x="LEFT", new_y="NEXT")
        self.pdf.set_xy(10, top + 5 + 4.5 * max(len(left[1]), len(right[1])) + 3)

    def pairs(self, rows: list[tuple[str, str]], size: int = 9, align: str = "L", bold_last: bool = False) -> None:
        for i, (k, v) in enumerate(rows):
            self.line(f"{k}: {v}", size, bold=bold_last and i == len(rows) - 1, align=align)

    def output(self) -> bytes:
        return bytes(self.pdf.output())


def render_pdf(invoice: dict[str, Any]) -> bytes:
    doc = _Pdf(_title(invoice))
    seller = invoice.get("seller")
    doc.header(_title(invoice), seller)
    if not seller:
        doc.wrapped(STATEMENT_NOTICE, 9, bold=True)
    buyer = invoice.get("buyer") or {"legal_name": invoice["account_name"]}
    doc.parties(("From", party_lines(seller) or ["(no seller identity configured)"]),
                ("Bill to", [*party_lines(buyer), f"Account {invoice['account_name']} (id {invoice['account_id']})"]))
    doc.pairs(_facts(invoice))
    doc.pdf.ln(3)
    doc.pdf.set_font(doc.family, "", 8)
    with doc.pdf.table(col_widths=(6, 74, 16, 22, 24, 18), text_align=("LEFT", "LEFT", "LEFT", "RIGHT", "RIGHT", "RIGHT")) as table:
        table.row(["#", "Description", "Period", "Tokens", "Unit price", "Amount"])
        for line in invoice["lines"]:
            table.row([
                str(line["position"]), doc.text(line["description"]), line["usage_period"], f"{line['tokens']:,}",
                doc.text(_unit(line)), money(line["amount_cents"]),
            ])
    doc.pdf.ln(3)
    rows = totals(invoice)
    for k, v in rows:
        doc.line(f"{k}: {v}", 10, bold=k.startswith("Total") or k in ("Amount due", "Charged back, owed again", REFUND_DUE), height=6, align="R")
    for note in _notes(invoice):
        doc.wrapped(note, 8)
    chargebacks = chargeback_lines(invoice)
    if chargebacks:
        doc.pdf.ln(2)
        doc.line("Chargebacks", 10, bold=True)
        for line in chargebacks:
            doc.wrapped(line, 8)
    doc.pdf.ln(2)
    doc.wrapped(ROUNDING_NOTE, 8)
    return doc.output()


def render_credit_note_pdf(note: dict[str, Any]) -> bytes:
    doc = _Pdf(_title(note))
    seller = note.get("seller")
    doc.header(_title(note), seller)
    doc.parties(("From", party_lines(seller) or ["(no seller identity configured)"]), ("Credit to", party_lines(note.get("buyer"))))
    doc.pairs([("Credit note number", note["number"]), ("Issue date", _date(note["issued_at"])),
               ("Credits invoice", note["invoice_number"]), ("Reason", note.get("reason") or "-")])
    if note.get("memo"):
        doc.wrapped(f"Memo: {note['memo']}", 9)
    doc.pdf.ln(3)
    for k, v in (("Subtotal", money(-note["subtotal_cents"])), ("Tax", money(-note["tax_cents"])),
                 (f"Total credited ({note['currency'].upper()})", money(-note["total_cents"]))):
        doc.line(f"{k}: {v}", 10, bold=k.startswith("Total"), height=6, align="R")
    doc.wrapped("Credited to your balance; applied to your next invoice." if note["applies_to"] == "balance"
                else "Reduces the amount due on the invoice it credits.", 8)
    return doc.output()


# prepaid statements (billing/invoices/statements.py) --------------------------------------------------------
def money_nanos(nanos: int) -> str:
    """nano-USD as dollars: $1,234.50, or every place needed ($0.000000150); negative: -$1.20."""
    sign = "-" if nanos < 0 else ""
    whole, frac = divmod(abs(nanos), 10**9)
    places = f"{frac:09d}".rstrip("0").ljust(2, "0")
    return f"{sign}${whole:,}.{places}"


CREDIT_KIND_NAMES = {"topup": "Top-up", "grant": "Grant", "refund": "Refund", "expiry": "Expired grant", "adjustment": "Adjustment"}


def statement_summary(doc: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(f"Opening balance ({_date(doc['period_start'])})", money_nanos(doc["opening_balance_nanos"]))]
    if doc["late_nanos"]:
        rows.append(("Recorded after the previous statement (earlier months' usage or credit)", money_nanos(doc["late_nanos"])))
    rows += [("Top-ups, grants, refunds, expiries, adjustments", money_nanos(doc["credits_nanos"])),
             ("Usage paid from the balance", money_nanos(-doc["usage_nanos"])),
             (f"Closing balance ({_date(doc['period_end'])})", money_nanos(doc["closing_balance_nanos"])),
             ("Amount due", "$0.00")]
    return rows


def _statement_credit_rows(doc: dict[str, Any]) -> list[list[str]]:
    return [[_date(c["created_at"]), CREDIT_KIND_NAMES.get(c["kind"], c["kind"]), c.get("reason") or c.get("external_id") or "",
             money_nanos(c["amount_nanos"])] for c in doc["credits"]]


def _statement_usage_rows(doc: dict[str, Any]) -> list[list[str]]:
    return [[u["model"], f"{u['requests']:,}", f"{u['prompt_tokens']:,}", f"{u['cached_tokens']:,}", f"{u['completion_tokens']:,}",
             money_nanos(-u["cost_nanos"])] for u in doc["usage"]]


def _statement_facts(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return [("Statement number", doc["number"]), ("Issue date", _date(doc["issued_at"])),
            ("Period", f"{doc['period']} ({_date(doc['period_start'])} to {_date(doc['period_end'])}, end exclusive, UTC)"),
            ("Currency", doc["currency"].upper()), ("Account", f"{doc['account_name']} (id {doc['account_id']}), prepaid")]


def render_statement_html(doc: dict[str, Any]) -> str:
    e = html.escape
    title = f"Prepaid statement {doc['number']}"

    def table(head: list[str], rows: list[list[str]], numeric_from: int, empty: str, id_: str) -> str:
        ths = "".join(f"<th{' class=n' if i >= numeric_from else ''}>{e(h)}</th>" for i, h in enumerate(head))
        body = "".join("<tr>" + "".join(f"<td{' class=n' if i >= numeric_from else ''}>{e(v)}</td>" for i, v in enumerate(r)) + "</tr>"
                       for r in rows) or f"<tr><td colspan={len(head)}>{e(empty)}</td></tr>"
        return f"<table id={id_}><thead><tr>{ths}</tr></thead><tbody>{body}</tbody></table>"

    summary = "".join(f"<tr{' class=total' if k.startswith(('Closing', 'Amount due')) else ''}><td>{e(k)}</td><td class=n>{e(v)}</td></tr>"
                      for k, v in statement_summary(doc))
    seller = doc.get("seller")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title><style>{STYLE}</style></head>
<body>
{_logo_html(seller)}<h1>{e(title)}</h1>
<p class=notice id=no-amount-due>{e(doc['notice'])}</p>
<div class=parties>
<div><h3>From</h3>{'<br>'.join(e(x) for x in party_lines(seller)) or '(no seller identity configured)'}</div>
<div><h3>Account holder</h3>{'<br>'.join(e(x) for x in party_lines(doc.get('buyer')))}</div>
</div>
<dl>{''.join(f'<dt>{e(k)}</dt><dd>{e(v)}</dd>' for k, v in _statement_facts(doc))}</dl>
<h2>Balance</h2>
<table class=totals id=statement-summary>{summary}</table>
<h2>Credits</h2>
{table(["Date", "Kind", "Reference", "Amount"], _statement_credit_rows(doc), 3, "No credit changes this month.", "statement-credits")}
<h2>Usage</h2>
{table(["Model", "Requests", "Prompt tokens", "Cached prompt tokens", "Completion tokens", "Debited"], _statement_usage_rows(doc), 1,
       "No usage this month.", "statement-usage")}
</body></html>
"""


def render_statement_pdf(doc: dict[str, Any]) -> bytes:
    title = f"Prepaid statement {doc['number']}"
    pdf = _Pdf(title)
    seller = doc.get("seller")
    pdf.header(title, seller)
    pdf.wrapped(doc["notice"], 9, bold=True)
    pdf.parties(("From", party_lines(seller) or ["(no seller identity configured)"]), ("Account holder", party_lines(doc.get("buyer"))))
    pdf.pairs(_statement_facts(doc))
    pdf.pdf.ln(2)
    for k, v in statement_summary(doc):
        pdf.line(f"{k}: {v}", 10, bold=k.startswith(("Closing", "Amount due")), height=6, align="R")
    for heading, head, rows, widths in (
        ("Credits", ["Date", "Kind", "Reference", "Amount"], _statement_credit_rows(doc), (22, 28, 100, 40)),
        ("Usage", ["Model", "Requests", "Prompt", "Cached prompt", "Completion", "Debited"], _statement_usage_rows(doc),
         (50, 22, 28, 30, 28, 32)),
    ):
        pdf.pdf.ln(2)
        pdf.line(heading, 11, bold=True)
        if not rows:
            pdf.line(f"No {heading.lower()} this month." if heading == "Usage" else "No credit changes this month.", 9)
            continue
        pdf.pdf.set_font(pdf.family, "", 8)
        with pdf.pdf.table(col_widths=widths, text_align=tuple("LEFT" if i == 0 or (heading == "Credits" and i < 3) else "RIGHT"
                                                               for i in range(len(head)))) as table:
            table.row(head)
            for r in rows:
                table.row([pdf.text(v) for v in r])
    return pdf.output()
