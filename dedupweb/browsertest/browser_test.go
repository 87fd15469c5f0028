// Package browsertest drives the dedupweb pages in a real, headless
// Chromium: a module of its own, so that users of the library never
// inherit chromedp. The tests skip, saying why, when Chromium is missing,
// unless DEDUP_REQUIRE_BROWSER=1 (as in CI): then they fail.
package browsertest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
)

// Environment variables.
const (
	requireEnv    = "DEDUP_REQUIRE_BROWSER" // fail instead of skipping without Chromium
	chromiumEnv   = "DEDUP_CHROMIUM"        // the browser binary (default /usr/bin/chromium, else from PATH)
	screenshotEnv = "DEDUPWEB_SCREENSHOTS"  // a directory to write the documentation's screenshots into
)

func TestMain(m *testing.M) { os.Exit(redistest.Main(m, "dedupweb browser")) }

// chromium finds the browser, or skips (fails under DEDUP_REQUIRE_BROWSER).
func chromium(t *testing.T) string {
	t.Helper()
	candidates := []string{os.Getenv(chromiumEnv), "/usr/bin/chromium"}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			candidates = append(candidates, p)
		}
	}
	for _, c := range candidates {
		if fi, err := os.Stat(c); c != "" && err == nil && !fi.IsDir() {
			return c
		}
	}
	msg := "no Chromium found (/usr/bin/chromium, $" + chromiumEnv + ", or chromium on PATH): apt-get install chromium; CI sets " + requireEnv + "=1"
	if os.Getenv(requireEnv) != "" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

// browser is one headless Chromium tab, and the dialogs it opened.
type browser struct {
	ctx     context.Context
	mu      sync.Mutex
	dialogs []string
}

// newBrowser starts a headless Chromium with a width×height window. It
// ends with the test.
func newBrowser(t *testing.T, width, height int) *browser {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromium(t)), chromedp.NoSandbox, chromedp.Headless, chromedp.DisableGPU,
		chromedp.WindowSize(width, height), chromedp.Flag("proxy-server", "direct://"),
		chromedp.Flag("proxy-bypass-list", "*"))
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelCtx := chromedp.NewContext(actx)
	t.Cleanup(func() { cancelCtx(); cancelAlloc() })
	if err := chromedp.Do(ctx); err != nil { // starts the browser, for the life of ctx
		t.Fatalf("start Chromium: %v", err)
	}
	b := &browser{ctx: ctx}
	err := chromedp.Listen(ctx, func(ev any) {
		if d, ok := ev.(*page.EventJavascriptDialogOpening); ok {
			b.mu.Lock()
			b.dialogs = append(b.dialogs, d.Message)
			b.mu.Unlock()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// stepTimeout bounds each batch of browser actions.
const stepTimeout = 30 * time.Second

// do runs actions, failing the test on an error.
func (b *browser) do(t *testing.T, what string, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, stepTimeout)
	defer cancel()
	if err := chromedp.Do(ctx, actions...); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// value runs one action and returns its value, failing the test on an
// error.
func value[T any](t *testing.T, b *browser, what string, a chromedp.Action[T]) T {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, stepTimeout)
	defer cancel()
	v, err := chromedp.Run(ctx, a)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return v
}

// text is the text of the first element matching the CSS selector, once
// visible.
func (b *browser) text(t *testing.T, sel string) string {
	t.Helper()
	b.do(t, "wait for "+sel, chromedp.WaitVisible(chromedp.CSS(sel)))
	return value(t, b, "read "+sel, chromedp.Text(chromedp.CSS(sel)))
}

// dialogsOpened returns the messages of the dialogs (alert, confirm) seen.
func (b *browser) dialogsOpened() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.dialogs...)
}

// screenshot writes the page as a PNG into $DEDUPWEB_SCREENSHOTS, when set.
func (b *browser) screenshot(t *testing.T, name string) {
	t.Helper()
	dir := os.Getenv(screenshotEnv)
	if dir == "" {
		return
	}
	png := value(t, b, "screenshot", chromedp.FullScreenshot(100))
	if err := os.WriteFile(filepath.Join(dir, name), png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %s", filepath.Join(dir, name))
}

// sel quotes a value for a CSS attribute selector or a JavaScript string.
func sel(s string) string { return fmt.Sprintf("%q", s) }

// noOverflow fails the test if the page is wider than width.
func (b *browser) noOverflow(t *testing.T, width int, page string) {
	t.Helper()
	if w := value(t, b, "page width", chromedp.Evaluate[int]("document.documentElement.scrollWidth")); w > width {
		t.Errorf("%s is %d px wide in a %d px viewport", page, w, width)
	}
}

func contains(t *testing.T, what, got, want string) {
	t.Helper()
	if !strings.Contains(got, want) {
		t.Errorf("%s: %q lacks %q", what, got, want)
	}
}
