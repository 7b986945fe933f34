"""A shopping cart: a price list, multi-buy offers and discount codes, and sales tax."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="cart",
    about="a shopping cart library (prices in cents)",
    packages=("shopcart", "checkout", "basket"),
    params={"TAX": ("8", "10", "20")},
    modules={
        "__init__.py": r'''"""A shopping cart with discounts and tax, in cents."""

from .cart import Cart
from .catalog import price_of
from .discounts import apply_discounts
from .tax import add_tax
''',
        "catalog.py": r'''"""Products and their prices in cents."""

PRICES = {"apple": 50, "bread": 250, "milk": 120, "cheese": 600}


def price_of(product):
    if product not in PRICES:
        raise KeyError(f"unknown product {product}")
    return PRICES[product]
''',
        "discounts.py": r'''"""Multi-buy offers and discount codes."""

from .catalog import price_of

CODES = {"SAVE10": ("percent", 10), "FIVEOFF": ("fixed", 500)}
MULTIBUY = {"apple": 3}  # buy 3, pay for 2


def multibuy_saving(lines):
    saving = 0
    for product, every in MULTIBUY.items():
        saving += lines.get(product, 0) // every * price_of(product)
    return saving


def apply_discounts(lines, subtotal, codes=()):
    """`subtotal` less multi-buy savings, then less each code, in order; never below zero."""
    total = subtotal - multibuy_saving(lines)
    for code in codes:
        code = code.strip().upper()
        if code not in CODES:
            raise ValueError(f"unknown code {code}")
        kind, amount = CODES[code]
        if kind == "percent":
            total -= total * amount // 100
        else:
            total -= amount
    return max(total, 0)
''',
        "tax.py": r'''"""Sales tax."""

TAX_PERCENT = @TAX@


def add_tax(cents):
    """`cents` plus TAX_PERCENT, rounded half up to a cent."""
    return cents + (cents * TAX_PERCENT + 50) // 100
''',
        "cart.py": r'''"""A shopping cart."""

from .catalog import price_of
from .discounts import apply_discounts
from .tax import add_tax


class Cart:
    def __init__(self):
        self.lines = {}

    def add(self, product, quantity=1):
        price_of(product)  # an unknown product fails here, not at checkout
        self.lines[product] = self.lines.get(product, 0) + quantity

    def remove(self, product, quantity=1):
        left = self.lines.get(product, 0) - quantity
        if left > 0:
            self.lines[product] = left
        else:
            self.lines.pop(product, None)

    def subtotal(self):
        return sum(price_of(p) * q for p, q in self.lines.items())

    def total(self, codes=()):
        """What the customer pays, in cents: the subtotal less discounts, plus tax."""
        return add_tax(apply_discounts(self.lines, self.subtotal(), codes))
''',
    },
    tests={
        "test_cart.py": r"""from @pkg@ import Cart, add_tax, apply_discounts


def test_subtotal():
    cart = Cart()
    cart.add("bread", 2)
    cart.add("milk")
    assert cart.subtotal() == 620


def test_remove_some():
    cart = Cart()
    cart.add("milk", 3)
    cart.remove("milk")
    assert cart.lines == {"milk": 2}


def test_unknown_product():
    try:
        Cart().add("caviar")
    except KeyError:
        return
    raise AssertionError("no KeyError")


def test_tax_zero():
    assert add_tax(0) == 0


def test_no_discount():
    assert apply_discounts({"milk": 1}, 120) == 120


def test_total_without_codes():
    cart = Cart()
    cart.add("bread")
    assert cart.total() == add_tax(250)
""",
    },
    sites=(
        Site(
            "remove_all",
            "off_by_one",
            "cart.py",
            "if left > 0:",
            "if left >= 0:",
            "Removing every unit of a product leaves it in the cart",
            'cart = Cart()\ncart.add("milk", 2)\ncart.remove("milk", 2)\ncart.lines',
        ),
        Site(
            "multibuy_count",
            "off_by_one",
            "discounts.py",
            "saving += lines.get(product, 0) // every * price_of(product)",
            "saving += (lines.get(product, 0) - 1) // every * price_of(product)",
            "Buying exactly three apples does not get the multi-buy offer",
            'cart = Cart()\ncart.add("apple", 3)\napply_discounts(cart.lines, cart.subtotal())',
        ),
        Site(
            "percent_divisor",
            "wrong_operator_or_constant",
            "discounts.py",
            "total -= total * amount // 100",
            "total -= total * amount // 10",
            "SAVE10 takes far more than ten percent off",
            'apply_discounts({"bread": 4}, 1000, ["SAVE10"])',
        ),
        Site(
            "floor_zero",
            "missing_case",
            "discounts.py",
            "return max(total, 0)",
            "return total",
            "A fixed discount larger than the order makes the total negative",
            'cart = Cart()\ncart.add("milk")\ncart.total(["FIVEOFF"])',
        ),
        Site(
            "tax_order",
            "wrong_cross_module_call",
            "cart.py",
            "return add_tax(apply_discounts(self.lines, self.subtotal(), codes))",
            "return apply_discounts(self.lines, add_tax(self.subtotal()), codes)",
            "total() with a fixed discount charges the wrong amount",
            'cart = Cart()\ncart.add("cheese", 2)\ncart.total(["FIVEOFF"])',
        ),
        Site(
            "code_case",
            "parsing_or_config",
            "discounts.py",
            "code = code.strip().upper()",
            "code = code.strip()",
            "Discount codes typed in lower case are refused",
            'apply_discounts({"bread": 4}, 1000, ["save10"])',
        ),
    ),
)
