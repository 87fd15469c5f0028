package browsertest

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/dedupweb"
	"github.com/asynq-dedup/dedup/dedupweb/internal/webtest"
	"github.com/chromedp/chromedp"
)

// The overview shows the right count in each queue, type and state cell.
func TestBrowserOverviewCounts(t *testing.T) {
	w := webtest.New(t)
	w.Enqueue(w.QA, "report:build", 42)
	w.Populate()
	srv := w.Serve(dedupweb.Options{})
	b := newBrowser(t, 1100, 800)
	b.do(t, "open the overview", chromedp.Navigate(srv.URL+"/"), chromedp.WaitVisible(chromedp.CSS("#tally")))
	row := func(q, typ string) string { return `tr[data-queue=` + sel(q) + `][data-type=` + sel(typ) + `] ` }
	for _, c := range []struct{ q, typ, state, want string }{
		{w.QA, "email:welcome", "waiting", "2"}, {w.QA, "", "orphaned", "1"}, // (a plain lock's type goes with its holder's record)
		{w.QA, "report:build", "waiting", "1"}, {w.QB, webtest.TypeBlock, "running", "1"},
		{w.QB, webtest.TypeFail, "retry-wait", "1"}, {w.QB, webtest.TypeCool, "cooling", "1"},
	} {
		if got := b.text(t, row(c.q, c.typ)+`td[data-state=`+sel(c.state)+`]`); got != c.want {
			t.Errorf("%s / %s %s shows %q, want %s", c.q, c.typ, c.state, got, c.want)
		}
	}
	if got := b.text(t, `td[data-total="all"]`); got != "7" {
		t.Errorf("total %q, want 7", got)
	}
	if bars := value(t, b, "count bars", chromedp.Evaluate[int](`document.querySelectorAll('.chart svg rect').length`)); bars == 0 {
		t.Error("no chart bars drawn")
	}
	b.screenshot(t, "dedupweb-overview.png")
}

// Search by type and field finds user 42's lock, through the real form.
// Its key has a mode (a fail hold), so the lock says how it was keyed.
func TestBrowserSearchFindsUser42(t *testing.T) {
	w := webtest.New(t)
	w.Enqueue(w.QA, "report:build", 41)
	info := w.Enqueue(w.QA, "report:build", 42, dedup.OnFailure(dedup.FailHold, time.Hour))
	srv := w.Serve(dedupweb.Options{AsynqmonRoot: "/monitoring"})
	b := newBrowser(t, 1100, 800)
	b.do(t, "search",
		chromedp.Navigate(srv.URL+"/search"),
		chromedp.SendKeys(chromedp.CSS(`#by-key input[name="type"]`), "report:build"),
		chromedp.SendKeys(chromedp.CSS(`#by-key input[name="queue"]`), w.QA),
		chromedp.SendKeys(chromedp.CSS(`#by-key textarea[name="field"]`), "user_id=42"),
		chromedp.Click(chromedp.CSS(`#by-key button`)),
		chromedp.WaitVisible(chromedp.CSS("#holder")))
	contains(t, "holder", b.text(t, "#holder"), info.ID)
	href := value(t, b, "holder link", chromedp.Evaluate[string](`document.querySelector('#holder a').getAttribute('href')`))
	if want := "/monitoring/queues/" + w.QA + "/tasks/" + info.ID; href != want {
		t.Errorf("holder links to %q, want %q", href, want)
	}
	contains(t, "lock page", b.text(t, "#lock"), "fields user_id")
	b.screenshot(t, "dedupweb-lock.png")
}

// A release without the CSRF token is refused; the real form releases.
func TestBrowserReleaseNeedsTheToken(t *testing.T) {
	w := webtest.New(t)
	info := w.Enqueue(w.QA, "email:welcome", 7)
	key := w.LockOf(info)
	srv := w.Serve(dedupweb.Options{AllowRelease: true})
	lockPage := srv.URL + "/lock?" + url.Values{"key": {key}}.Encode()
	b := newBrowser(t, 1100, 800)
	b.do(t, "submit without the token",
		chromedp.Navigate(lockPage),
		chromedp.Click(chromedp.CSS("#release")),
		chromedp.WaitVisible(chromedp.CSS("#release-form")),
		chromedp.Evaluate[chromedp.Void](`document.querySelector('#release-form input[name="csrf"]').remove()`),
		chromedp.Click(chromedp.CSS("#confirm")),
		chromedp.WaitVisible(chromedp.CSS("#error")))
	contains(t, "refusal", b.text(t, "#error"), "no CSRF token")
	if !w.Exists(key) {
		t.Fatal("released without the token")
	}
	b.do(t, "submit the real form",
		chromedp.Navigate(lockPage),
		chromedp.Click(chromedp.CSS("#release")),
		chromedp.WaitVisible(chromedp.CSS("#release-form")),
		chromedp.Click(chromedp.CSS("#confirm")),
		chromedp.WaitVisible(chromedp.CSS("#result")))
	contains(t, "result", b.text(t, "#result"), "released "+key)
	if w.Exists(key) {
		t.Fatal("the lock is still there")
	}
}

// Read-only: no release button, and a posted form is refused.
func TestBrowserReadOnly(t *testing.T) {
	w := webtest.New(t)
	key := w.LockOf(w.Enqueue(w.QA, "email:welcome", 8))
	srv := w.Serve(dedupweb.Options{})
	b := newBrowser(t, 1100, 800)
	b.do(t, "open the lock page", chromedp.Navigate(srv.URL+"/lock?"+url.Values{"key": {key}}.Encode()),
		chromedp.WaitVisible(chromedp.CSS("#lock")))
	if buttons := value(t, b, "count release controls", chromedp.Evaluate[int](`document.querySelectorAll('#release, form[method="post"], button.danger').length`)); buttons != 0 {
		t.Errorf("read-only lock page has %d release controls", buttons)
	}
	post := `(() => { const f = document.createElement('form'); f.method = 'post'; f.action = '/release';
		const i = document.createElement('input'); i.name = 'key'; i.value = ` + sel(key) + `; f.appendChild(i);
		document.body.appendChild(f); f.submit(); })()`
	b.do(t, "post a release", chromedp.Evaluate[chromedp.Void](post), chromedp.WaitVisible(chromedp.CSS("#error")))
	contains(t, "refusal", b.text(t, "#error"), "read-only")
	if !w.Exists(key) {
		t.Fatal("a read-only handler released the lock")
	}
}

// A type named like a script is shown as text, and runs nothing.
func TestBrowserEscapesNames(t *testing.T) {
	w := webtest.New(t)
	const evil = `<script>alert(1)</script>`
	key := w.LockOf(w.Enqueue(w.QA, evil, 9))
	srv := w.Serve(dedupweb.Options{AllowRelease: true})
	b := newBrowser(t, 1100, 800)
	for _, p := range []struct{ path, sel string }{
		{"/", "#tally"}, {"/locks", "#locks"}, {"/lock?" + url.Values{"key": {key}}.Encode(), "#lock"},
	} {
		b.do(t, "open "+p.path, chromedp.Navigate(srv.URL+p.path), chromedp.WaitVisible(chromedp.CSS(p.sel)))
		contains(t, p.path, b.text(t, p.sel), evil)
		if scripts := value(t, b, "count scripts", chromedp.Evaluate[int](`document.querySelectorAll('script').length`)); scripts != 0 {
			t.Errorf("%s has %d script elements", p.path, scripts)
		}
	}
	if d := b.dialogsOpened(); len(d) != 0 {
		t.Errorf("dialogs opened: %q", d)
	}
}

// Every page fits a 390 px wide phone screen.
func TestBrowserMobileWidth(t *testing.T) {
	w := webtest.New(t)
	info := w.Enqueue(w.QA, "report:build", 42)
	w.Orphan(w.Enqueue(w.QA, "email:welcome-with-a-rather-long-type-name", 1))
	w.StartServer()
	if err := w.D.FlushStats(context.Background()); err != nil {
		t.Fatal(err)
	}
	srv := w.Serve(dedupweb.Options{AllowRelease: true, AsynqmonRoot: "/monitoring"})
	b := newBrowser(t, 390, 844)
	b.do(t, "emulate a phone", chromedp.EmulateViewport(390, 844))
	for _, p := range []struct{ path, sel string }{
		{"/", "#tally"}, {"/locks", "#locks"}, {"/lock?" + url.Values{"key": {w.LockOf(info)}}.Encode(), "#lock"},
		{"/search", "#by-key"}, {"/doctor?grace=0s", "#findings"},
		{"/release?" + url.Values{"key": {w.LockOf(info)}}.Encode(), "#release-form"},
	} {
		b.do(t, "open "+p.path, chromedp.Navigate(srv.URL+p.path), chromedp.WaitVisible(chromedp.CSS(p.sel)))
		b.noOverflow(t, 390, p.path)
	}
}
