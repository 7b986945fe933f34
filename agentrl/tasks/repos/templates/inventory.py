"""An inventory: a catalogue read from text, stock levels, and reports."""

from agentrl.tasks.repos.template import Site, Template

TEMPLATE = Template(
    name="inventory",
    about="a small inventory manager",
    packages=("inventory", "stockroom", "warehouse"),
    params={"LOW": ("3", "5")},
    modules={
        "__init__.py": r'''"""Track a catalogue and its stock."""

from .inventory import Inventory
from .report import format_cents, low_stock_report
''',
        "items.py": r'''"""Catalogue items."""


class Item:
    """A stock-keeping unit with a unit price in cents."""

    def __init__(self, sku, name, price_cents):
        if price_cents < 0:
            raise ValueError("negative price")
        self.sku = sku
        self.name = name
        self.price_cents = price_cents


def parse_item(line):
    """An Item from a `sku|name|price` line, the price in cents."""
    sku, name, price = line.split("|")
    return Item(sku.strip().upper(), name.strip(), int(price))
''',
        "stock.py": r'''"""Stock levels per SKU."""


class Stock:
    def __init__(self):
        self.levels = {}

    def add(self, sku, quantity):
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        self.levels[sku] = self.levels.get(sku, 0) + quantity

    def remove(self, sku, quantity):
        """Take `quantity` away; ValueError when fewer are in stock."""
        have = self.levels.get(sku, 0)
        if quantity > have:
            raise ValueError(f"only {have} of {sku} in stock")
        self.levels[sku] = have - quantity

    def level(self, sku):
        return self.levels.get(sku, 0)
''',
        "inventory.py": r'''"""An inventory: a catalogue and its stock."""

from .items import parse_item
from .stock import Stock


class Inventory:
    def __init__(self):
        self.items = {}
        self.stock = Stock()

    def load(self, text):
        """Add the items of a catalogue, one `sku|name|price` per line; `#` starts a comment line."""
        for line in text.splitlines():
            if line.strip() and not line.startswith("#"):
                item = parse_item(line)
                self.items[item.sku] = item

    def receive(self, sku, quantity):
        self.stock.add(self._known(sku), quantity)

    def ship(self, sku, quantity):
        self.stock.remove(self._known(sku), quantity)

    def level(self, sku):
        return self.stock.level(self._known(sku))

    def _known(self, sku):
        sku = sku.upper()
        if sku not in self.items:
            raise KeyError(f"unknown sku {sku}")
        return sku

    def value_cents(self):
        """What the stock is worth: level times price, over all items."""
        return sum(self.stock.level(sku) * item.price_cents for sku, item in self.items.items())
''',
        "report.py": r'''"""Text reports of an inventory."""


def format_cents(cents):
    """`1234` -> `"12.34"`."""
    return f"{cents // 100}.{cents % 100:02d}"


def low_stock_report(inventory, threshold=@LOW@):
    """One `SKU name: level` line per item whose level is below `threshold`, by SKU."""
    lines = []
    for sku in sorted(inventory.items):
        level = inventory.stock.level(sku)
        if level < threshold:
            lines.append(f"{sku} {inventory.items[sku].name}: {level}")
    return "\n".join(lines)
''',
    },
    tests={
        "test_inventory.py": r"""from @pkg@ import Inventory, format_cents, low_stock_report

CATALOGUE = "# sku|name|price\nA1|apple|50\nB2|bread|250"


def make():
    inv = Inventory()
    inv.load(CATALOGUE)
    return inv


def test_load():
    assert sorted(make().items) == ["A1", "B2"]


def test_receive():
    inv = make()
    inv.receive("A1", 10)
    assert inv.level("A1") == 10


def test_ship_some():
    inv = make()
    inv.receive("B2", 4)
    inv.ship("B2", 1)
    assert inv.level("B2") == 3


def test_value():
    inv = make()
    inv.receive("A1", 2)
    inv.receive("B2", 1)
    assert inv.value_cents() == 350


def test_format_cents():
    assert format_cents(250) == "2.50"


def test_low_stock():
    inv = make()
    inv.receive("A1", 10)
    assert low_stock_report(inv) == "B2 bread: 0"


def test_overship():
    inv = make()
    inv.receive("A1", 1)
    try:
        inv.ship("A1", 2)
    except ValueError:
        return
    raise AssertionError("no ValueError")
""",
    },
    sites=(
        Site(
            "ship_all",
            "off_by_one",
            "stock.py",
            "if quantity > have:",
            "if quantity >= have:",
            "ship() refuses to ship the last units in stock",
            'inv = Inventory()\ninv.load("A1|apple|50")\ninv.receive("A1", 3)\ninv.ship("A1", 3)\ninv.level("A1")',
        ),
        Site(
            "low_threshold",
            "off_by_one",
            "report.py",
            "if level < threshold:",
            "if level <= threshold:",
            "low_stock_report() lists items that have exactly the threshold in stock",
            'inv = Inventory()\ninv.load("A1|apple|50")\ninv.receive("A1", @LOW@)\nlow_stock_report(inv)',
        ),
        Site(
            "cents_digits",
            "wrong_operator_or_constant",
            "report.py",
            "{cents % 100:02d}",
            "{cents % 10:02d}",
            "format_cents() shows the wrong cents",
            "format_cents(1234)",
            ("format_cents(99)",),
        ),
        Site(
            "sku_case",
            "missing_case",
            "inventory.py",
            "        sku = sku.upper()\n",
            "",
            "Lower-case SKUs are reported as unknown",
            'inv = Inventory()\ninv.load("A1|apple|50")\ninv.receive("a1", 2)\ninv.level("A1")',
        ),
        Site(
            "ship_call",
            "wrong_cross_module_call",
            "inventory.py",
            "self.stock.remove(self._known(sku), quantity)",
            "self.stock.add(self._known(sku), quantity)",
            "Shipping an item increases its stock",
            'inv = Inventory()\ninv.load("A1|apple|50")\ninv.receive("A1", 5)\ninv.ship("A1", 2)\ninv.level("A1")',
            (
                'inv = Inventory()\ninv.load("X|x|1")\n'
                'try:\n    inv.ship("X", 1)\nexcept ValueError:\n    pass\ninv.level("X")',
            ),
        ),
        Site(
            "field_separator",
            "parsing_or_config",
            "items.py",
            'sku, name, price = line.split("|")',
            'sku, name, price = line.split(",")',
            "load() fails on a catalogue in the documented format",
            'inv = Inventory()\ninv.load("A1|apple|50")\nsorted(inv.items)',
        ),
    ),
)
