"""An EPUB's table of contents read from its documents: links resolved against the document's folder,
fragments kept, untitled entries and links outside the toc `<nav>` left out, NCX in document order."""

import xml.etree.ElementTree as ET

from app.books.reading.epub_toc import nav_entries, ncx_entries, split_href

NCX_NS = "http://www.daisy.org/z3986/2005/ncx/"


def test_a_link_is_resolved_against_its_documents_folder_with_its_fragment() -> None:
    assert split_href("OEBPS/nav.xhtml", "text/ch%201.xhtml#p3") == ("OEBPS/text/ch 1.xhtml", "p3")
    assert split_href("OEBPS/toc/nav.xhtml", "../ch2.xhtml") == ("OEBPS/ch2.xhtml", None)


def test_the_nav_document_gives_the_titled_links_of_its_toc_nav_only() -> None:
    xhtml = """<html><body>
      <nav epub:type="landmarks"><a href="cover.xhtml">Cover</a></nav>
      <nav epub:type="toc"><ol>
        <li><a href="ch1.xhtml">Chapter   <b>One</b></a></li>
        <li><a href="ch1.xhtml#s2">Two</a><nav><a href="ch3.xhtml">Three</a></nav></li>
        <li><a href="blank.xhtml">  </a></li>
      </ol></nav></body></html>"""
    assert nav_entries("OEBPS/nav.xhtml", xhtml) == [
        ("OEBPS/ch1.xhtml", None, "Chapter One"), ("OEBPS/ch1.xhtml", "s2", "Two"),
        ("OEBPS/ch3.xhtml", None, "Three")]


def test_the_ncx_gives_its_titled_nav_points_in_document_order() -> None:
    ncx = ET.fromstring(f"""<ncx xmlns="{NCX_NS}"><navMap>
      <navPoint><navLabel><text>First</text></navLabel><content src="a.html"/>
        <navPoint><navLabel><text> Inner </text></navLabel><content src="a.html#x"/></navPoint>
      </navPoint>
      <navPoint><navLabel><text></text></navLabel><content src="b.html"/></navPoint>
      <navPoint><navLabel><text>No content</text></navLabel></navPoint>
    </navMap></ncx>""")
    assert ncx_entries("EPUB/toc.ncx", ncx, NCX_NS) == [("EPUB/a.html", None, "First"),
                                                          ("EPUB/a.html", "x", "Inner")]
