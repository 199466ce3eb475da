"""Who an account's invoices are made out to, the tax it pays, and document numbers without gaps.

    billing details   legal name, address, country, billing email, tax id (and its Stripe type),
                      an optional tax rate of its own; validated here, one message per bad field
    tax rates         per country (percent, exact to 0.001); an account's own rate wins
    tax               subtotal x rate / 100, rounded half up to the cent once (never per line)
    numbers           per seller and kind, taken in the transaction that inserts the document
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from billing.decimals import plain_decimal
from billing.invoices.models import BillingDetails, DocumentSequence, TaxRate
from billing.models import utcnow

DETAILS = BillingDetails.__table__
TAX_RATES = TaxRate.__table__
SEQUENCES = DocumentSequence.__table__

# ISO 3166-1 alpha-2, officially assigned codes.
COUNTRIES = frozenset("""
AD AE AF AG AI AL AM AO AQ AR AS AT AU AW AX AZ BA BB BD BE BF BG BH BI BJ BL BM BN BO BQ BR BS BT BV BW BY BZ CA CC CD
CF CG CH CI CK CL CM CN CO CR CU CV CW CX CY CZ DE DJ DK DM DO DZ EC EE EG EH ER ES ET FI FJ FK FM FO FR GA GB GD GE GF
GG GH GI GL GM GN GP GQ GR GS GT GU GW GY HK HM HN HR HT HU ID IE IL IM IN IO IQ IR IS IT JE JM JO JP KE KG KH KI KM KN
KP KR KW KY KZ LA LB LC LI LK LR LS LT LU LV LY MA MC MD ME MF MG MH MK ML MM MN MO MP MQ MR MS MT MU MV MW MX MY MZ NA
NC NE NF NG NI NL NO NP NR NU NZ OM PA PE PF PG PH PK PL PM PN PR PS PT PW PY QA RE RO RS RU RW SA SB SC SD SE SG SH SI
SJ SK SL SM SN SO SR SS ST SV SX SY SZ TC TD TF TG TH TJ TK TL TM TN TO TR TT TV TW TZ UA UG UM US UY UZ VA VC VE VG VI
VN VU WF WS YE YT ZA ZM ZW
""".split())
# Stripe's customer tax id types this gateway accepts (a subset of Stripe's list).
TAX_ID_TYPES = frozenset({
    "eu_vat", "gb_vat", "ch_vat", "no_vat", "us_ein", "ca_bn", "au_abn", "nz_gst", "in_gst", "jp_cn", "sg_gst", "za_vat",
    "br_cnpj", "mx_rfc", "kr_brn", "ae_trn", "il_vat", "tr_tin",
})
EU = frozenset("AT BE BG CY CZ DE DK EE ES FI FR GR HR HU IE IT LT LU LV MT NL PL PT RO SE SI SK".split())
_EMAIL = re.compile(r"^[^@\s<>\"']+@[^@\s<>\"']+\.[^@\s<>\"']+$")
MAX_RATE = Decimal(100)
TEXT_FIELDS = {"legal_name": 200, "address_line1": 200, "address_line2": 200, "city": 100, "postal_code": 20, "region": 100,
               "email": 254, "tax_id": 64}
FIELDS = (*TEXT_FIELDS, "country", "tax_id_type", "tax_rate")


class InvalidBillingDetails(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def parse_rate(value: Any, field: str = "tax_rate") -> Decimal:
    """A tax rate in percent: a decimal string or integer from 0 to 100, at most 3 decimals ("19.000")."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidBillingDetails(field, f"{field} must be a decimal string of a percentage such as \"19.000\"")
    try:
        rate = plain_decimal(value)
    except InvalidOperation:
        raise InvalidBillingDetails(field, f"{field} must be a decimal percentage such as \"19.000\", got {value!r}") from None
    if not rate.is_finite() or rate < 0 or rate > MAX_RATE:
        raise InvalidBillingDetails(field, f"{field} must be between 0 and 100 (percent), got {value!r}")
    if rate != rate.quantize(Decimal("0.001"), ROUND_HALF_UP):
        raise InvalidBillingDetails(field, f"{field} has more than 3 decimal places: {value!r}")
    return rate.quantize(Decimal("0.001"))


def parse_country(value: Any, field: str = "country") -> str:
    if not isinstance(value, str) or value.strip().upper() not in COUNTRIES:
        raise InvalidBillingDetails(field, f"{field} must be an ISO 3166-1 alpha-2 country code such as \"DE\", got {value!r}")
    return value.strip().upper()


def validate(body: dict[str, Any], current: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields of `body` (a full set, or changes over `current`) checked and normalised."""
    if not isinstance(body, dict):
        raise InvalidBillingDetails("body", "the body must be a JSON object of billing details")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise InvalidBillingDetails(unknown[0], f"unknown field {unknown[0]!r}; billing details take {', '.join(FIELDS)}")
    out: dict[str, Any] = {k: (current or {}).get(k) for k in FIELDS}
    if out["tax_rate"] is not None:  # the stored view's text back to an exact decimal
        out["tax_rate"] = parse_rate(out["tax_rate"])
    for name, value in body.items():
        if name in TEXT_FIELDS:
            if value is not None and not isinstance(value, str):
                raise InvalidBillingDetails(name, f"{name} must be a string")
            value = (value or "").strip() or None
            if value is not None and len(value) > TEXT_FIELDS[name]:
                raise InvalidBillingDetails(name, f"{name} is longer than {TEXT_FIELDS[name]} characters")
            if value is not None and any(ord(c) < 32 for c in value):
                raise InvalidBillingDetails(name, f"{name} holds control characters")
        elif name == "country":
            value = parse_country(value)
        elif name == "tax_id_type":
            if value is not None and (not isinstance(value, str) or value not in TAX_ID_TYPES):
                raise InvalidBillingDetails(name, f"tax_id_type must be one of {', '.join(sorted(TAX_ID_TYPES))} (Stripe's names)")
        elif name == "tax_rate":
            value = None if value is None else parse_rate(value)
        out[name] = value
    if not out.get("legal_name"):
        raise InvalidBillingDetails("legal_name", "legal_name must not be empty")
    if not out.get("country"):
        raise InvalidBillingDetails("country", "country is required (ISO 3166-1 alpha-2, e.g. \"DE\")")
    if out.get("email") is not None and not _EMAIL.match(out["email"]):
        raise InvalidBillingDetails("email", f"email is not an email address: {out['email']!r}")
    if out.get("tax_id") and not out.get("tax_id_type"):
        out["tax_id_type"] = default_tax_id_type(out["country"])
    if out.get("tax_id_type") and not out.get("tax_id"):
        out["tax_id_type"] = None
    return out


def default_tax_id_type(country: str) -> str | None:
    if country in EU:
        return "eu_vat"
    return {"GB": "gb_vat", "CH": "ch_vat", "NO": "no_vat", "US": "us_ein", "CA": "ca_bn", "AU": "au_abn", "NZ": "nz_gst",
            "IN": "in_gst", "SG": "sg_gst", "ZA": "za_vat"}.get(country)


def _upsert(conn: AsyncConnection, table: sa.Table) -> Any:
    return postgresql.insert(table) if conn.dialect.name == "postgresql" else sqlite.insert(table)


def view(row: Any) -> dict[str, Any]:
    values = dict(row._mapping)
    rate = values.get("tax_rate")
    return {
        "object": "billing_details",
        **{k: values.get(k) for k in FIELDS if k != "tax_rate"},
        "account_id": values["account_id"],
        "tax_rate": None if rate is None else format(Decimal(rate).quantize(Decimal("0.001")), "f"),
        "updated_at": values["updated_at"].isoformat() if values.get("updated_at") else None,
    }


async def get_details(db: AsyncEngine | AsyncConnection, account_id: int) -> dict[str, Any] | None:
    query = sa.select(DETAILS).where(DETAILS.c.account_id == account_id)
    if isinstance(db, AsyncConnection):
        row = (await db.execute(query)).first()
    else:
        async with db.connect() as conn:
            row = (await conn.execute(query)).first()
    return None if row is None else view(row)


async def set_details(db: AsyncEngine, account_id: int, body: dict[str, Any], *, replace: bool = False) -> dict[str, Any]:
    """Creates or changes an account's billing details (PUT: `replace`; PATCH: changes over the stored ones)."""
    current = None if replace else await get_details(db, account_id)
    fields = validate(body, current)
    values = {**fields, "account_id": account_id, "updated_at": utcnow()}
    async with db.begin() as conn:
        stmt = _upsert(conn, DETAILS).values(**values)
        await conn.execute(stmt.on_conflict_do_update(index_elements=["account_id"], set_={k: values[k] for k in values if k != "account_id"}))
        return await get_details(conn, account_id)  # type: ignore[return-value]


# tax --------------------------------------------------------------------------------------------
async def set_country_rate(db: AsyncEngine, country: str, rate: Any) -> dict[str, Any]:
    code, value = parse_country(country), parse_rate(rate, "rate")
    async with db.begin() as conn:
        stmt = _upsert(conn, TAX_RATES).values(country=code, rate=value, updated_at=utcnow())
        await conn.execute(stmt.on_conflict_do_update(index_elements=["country"], set_={"rate": value, "updated_at": utcnow()}))
    return {"object": "tax_rate", "country": code, "rate": format(value, "f")}


async def delete_country_rate(db: AsyncEngine, country: str) -> bool:
    code = parse_country(country)
    async with db.begin() as conn:
        return bool((await conn.execute(TAX_RATES.delete().where(TAX_RATES.c.country == code))).rowcount)


async def country_rates(db: AsyncEngine) -> list[dict[str, Any]]:
    async with db.connect() as conn:
        rows = (await conn.execute(sa.select(TAX_RATES).order_by(TAX_RATES.c.country))).all()
    return [{"object": "tax_rate", "country": r.country, "rate": format(Decimal(r.rate).quantize(Decimal("0.001")), "f")} for r in rows]


@dataclass(frozen=True)
class TaxChoice:
    rate: Decimal | None  # percent; None: no tax
    source: str  # account | country | none

    def label(self) -> str:
        return f"Tax {format(self.rate, 'f')}%" if self.rate is not None else ""


async def tax_for(conn: AsyncConnection, details: dict[str, Any] | None) -> TaxChoice:
    """The account's own rate, else its country's, else none."""
    if details is None:
        return TaxChoice(None, "none")
    if details.get("tax_rate") is not None:
        return TaxChoice(Decimal(details["tax_rate"]), "account")
    rate = (await conn.execute(sa.select(TAX_RATES.c.rate).where(TAX_RATES.c.country == details["country"]))).scalar_one_or_none()
    if rate is None:
        return TaxChoice(None, "none")
    return TaxChoice(Decimal(rate).quantize(Decimal("0.001")), "country")


def tax_cents(subtotal_cents: int, rate: Decimal | None) -> int:
    """Tax on the whole subtotal, rounded half up to the cent once."""
    if rate is None or subtotal_cents == 0:
        return 0
    return int((Decimal(subtotal_cents) * rate / Decimal(100)).quantize(Decimal(1), ROUND_HALF_UP))


def split_tax(amounts: list[int], tax: int) -> list[int]:
    """`tax` shared over line amounts in proportion, largest remainders first, summing to `tax` exactly
    (what each line carries to Stripe, whose invoice total adds the lines' tax amounts)."""
    base = sum(amounts)
    if base <= 0 or tax == 0:
        return [0] * len(amounts)
    shares = [Decimal(a) * tax / base for a in amounts]
    floors = [int(s.to_integral_value(rounding="ROUND_FLOOR")) for s in shares]
    left = tax - sum(floors)
    order = sorted(range(len(amounts)), key=lambda i: (floors[i] - shares[i], i))
    for i in order[:left]:
        floors[i] += 1
    return floors


# numbers ----------------------------------------------------------------------------------------
async def next_number(conn: AsyncConnection, seller: str, kind: str) -> int:
    """The next number of `kind` for `seller`, inside the caller's transaction: the row stays locked
    until it commits (concurrent closes queue here), and a rollback gives the number back."""
    await conn.execute(_upsert(conn, SEQUENCES).values(seller=seller, kind=kind, last_number=0).on_conflict_do_nothing())
    query = (
        SEQUENCES.update()
        .where(SEQUENCES.c.seller == seller, SEQUENCES.c.kind == kind)
        .values(last_number=SEQUENCES.c.last_number + 1)
        .returning(SEQUENCES.c.last_number)
    )
    return int((await conn.execute(query)).scalar_one())
